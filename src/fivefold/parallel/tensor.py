"""Tensor (+ sequence) parallelism: Megatron-style splits applied from outside with DTensor.

Per block (h = hidden, b·s tokens):
  * attention: q/k/v column-parallel (each rank owns heads/tp query heads and their KV heads),
    o row-parallel; MLP: gate/up column-parallel, down row-parallel.
  * The block's attention and MLP take their input as one replicated DTensor, so the backward
    sums the three (q, k, v) or two (gate, up) partial input gradients first and reduces once:
    exactly two all-reduces of b·s·h per layer per pass (forward: o and down; backward: the
    attention and MLP inputs).
  * `sp=True` keeps the residual stream and the norms sharded along the sequence: each of those
    all-reduces becomes an all-gather (entering attention / MLP) plus a reduce-scatter (leaving it).
  * grouped-query attention with tp > kv_heads (tp a multiple of kv_heads): the K/V projections
    stay whole on every rank and each rank keeps only the KV head its query heads read; their
    weight gradients are summed over the tensor-parallel ranks.
  * the embedding is vocabulary-parallel (row-wise) and the head column-parallel over the
    vocabulary; the loss is computed on the vocabulary shards under `loss_parallel()`.
  * per-head q/k norms (Qwen3) normalise the rank's own heads with a replicated weight: its
    gradient is a partial sum over the tensor-parallel ranks, reduced like SP's norms'.
  * MoE blocks: router and experts stay whole and replicated on every tensor-parallel rank; with
    sequence parallelism they see the gathered full sequence and hand back their sequence shard.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from fivefold.config import ModelSpec
from fivefold.model.moe import MoE
from fivefold.support import check_tensor_shapes


class ReplicatedKVHead(ParallelStyle):
    """K or V projection when tp > kv_heads: whole weight on every rank, one KV head kept.

    Rank r's query heads all read KV head r // (tp / kv_heads). The projection's output is
    marked as a partial gradient (each rank only back-propagates into its own head), so the
    weight gradient is summed over the tensor-parallel ranks, which is the exact gradient.
    """

    def __init__(self, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.head_dim = head_dim

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            replicated = nn.Parameter(distribute_tensor(param, mesh, [Replicate()], src_data_rank=None))
            module.register_parameter(pname, replicated)

    def _prepare_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        elif x.placements != (Replicate(),):
            x = x.redistribute(placements=[Replicate()])
        return (x, *inputs[1:])

    def _prepare_output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        tp = mesh.size()
        head = mesh.get_local_rank() // (tp // self.kv_heads)
        local = output.to_local(grad_placements=[Partial()])
        return local[..., head * self.head_dim : (head + 1) * self.head_dim]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(
            module,
            device_mesh,
            self._partition,
            lambda mod, inputs, mesh: self._prepare_input(mod, inputs, mesh),
            lambda mod, output, mesh: self._prepare_output(mod, output, mesh),
        )


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """Shapes TP can split; raises FivefoldError naming the constraint and valid degrees."""
    check_tensor_shapes(spec, tp)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, spec: ModelSpec, sp: bool) -> None:
    """Shard `model` (a whole Transformer or a pipeline chunk of one) over `tp_mesh` in place."""
    tp = tp_mesh.size()
    check_tensor_parallel(spec, tp)
    seq = Shard(1)
    stream = seq if sp else Replicate()  # layout of the residual stream between blocks
    decoder = model.model
    if decoder.embed_tokens is not None:
        parallelize_module(
            decoder.embed_tokens,
            tp_mesh,
            RowwiseParallel(input_layouts=Replicate(), output_layouts=stream, use_local_output=not sp),
        )
    kv_style: ParallelStyle = (
        ColwiseParallel() if tp <= spec.kv_heads else ReplicatedKVHead(spec.kv_heads, spec.head_dim)
    )
    for block in decoder.layers.values():
        plan: dict[str, ParallelStyle] = {
            "self_attn": PrepareModuleInput(
                input_layouts=(stream, None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=False,
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": kv_style,
            "self_attn.v_proj": kv_style,
            "self_attn.o_proj": RowwiseParallel(output_layouts=stream, use_local_output=not sp),
        }
        if sp:
            plan["input_layernorm"] = SequenceParallel()
            plan["post_attention_layernorm"] = SequenceParallel()
        if spec.qk_norm:  # per-head q/k norms on the rank's heads: a replicated weight whose input is
            # sharded over the heads (dim 2), so its gradient is a partial sum, reduced over tp
            plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if isinstance(block.mlp, MoE):
            if sp:  # experts run replicated on the gathered sequence and hand back their shard
                plan["mlp"] = _gather_scatter(seq)
        else:
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=False
            )
            plan["mlp.gate_proj"] = ColwiseParallel()
            plan["mlp.up_proj"] = ColwiseParallel()
            plan["mlp.down_proj"] = RowwiseParallel(output_layouts=stream, use_local_output=not sp)
        parallelize_module(block, tp_mesh, plan)
    if decoder.norm is not None and sp:
        parallelize_module(decoder.norm, tp_mesh, SequenceParallel())
    if model.lm_head is not None:
        parallelize_module(
            model.lm_head,
            tp_mesh,
            ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
        )
    if spec.tie_embeddings and decoder.embed_tokens is not None and model.lm_head is not None:
        # both split the vocabulary rows (Shard(0)): one DTensor serves as both weights again
        model.lm_head.weight = decoder.embed_tokens.weight
    if sp:
        _hand_over_sequence_shards(model, tp_mesh)
    model._tp_mesh = tp_mesh  # read by `loss_context`


def _gather_scatter(seq: Shard) -> ParallelStyle:
    """Around a module that must see the full sequence: all-gather in, keep this rank's shard out.

    Backward: the output gradient is all-gathered (every rank computed the same full output), and
    the input gradient is cut to this rank's shard, without a sum.
    """
    return PrepareModuleInputOutput(
        input_layouts=(seq,),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(seq,),
        use_local_output=False,
    )


def _hand_over_sequence_shards(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Pipeline chunks with SP pass plain local sequence shards between stages."""
    decoder = model.model
    if decoder.embed_tokens is None:

        def to_dtensor(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)
            return (x, *args[1:]), kwargs

        model.register_forward_pre_hook(to_dtensor, with_kwargs=True)
    if decoder.norm is None and model.lm_head is None:

        def to_local(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            # a fresh tensor, not a view of the DTensor: the V-shaped schedules hand it to the next
            # chunk on the same rank and detach it in place there
            return output.to_local().clone() if isinstance(output, DTensor) else output

        model.register_forward_hook(to_local)


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """`loss_parallel()` when the head is vocabulary-sharded, else nothing; wrap forward and backward."""
    if getattr(model, "_tp_mesh", None) is not None and getattr(model, "lm_head", None) is not None:
        return loss_parallel()
    return contextlib.nullcontext()
