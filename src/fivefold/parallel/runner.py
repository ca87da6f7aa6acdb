"""`ParallelRunner`: the StepRunner for every layout without pipelining.

One optimizer step on this rank:
  * its share of the global batch is split into micro-batches; gradient synchronisation (DDP's
    bucketed all-reduce, FSDP's reduce-scatter / HSDP's all-reduce) runs only on the last one;
  * each micro-batch loss is scaled by 1/accumulation; the data-parallel reductions average
    over replicas, so the gradient is that of the mean loss over the global batch;
  * gradients DTensor left partial (replicated norm weights under SP) are summed over `tp`, and
    full-size ones of sharded weights cut to their shard;
  * the returned loss is that mean, all-reduced over the ranks that hold different data.

The global gradient norm sums squares of local gradient shards, reduced over exactly the mesh
dims each gradient is sharded on (a DTensor's non-Replicate placements), so a replicated
gradient counts once and a sharded one over all its pieces.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fivefold.config import Layout, TrainSpec
from fivefold.model.moe import moe_layers, set_aux_loss_scale
from fivefold.model.transformer import lm_loss
from fivefold.parallel.data import make_optimizer
from fivefold.parallel.gradnorm import grad_norm_squared
from fivefold.parallel.precision import forward_context
from fivefold.parallel.tensor import loss_context


class ParallelRunner:
    def __init__(
        self, model: nn.Module, wrapped: nn.Module, runtime_mesh: Any, layout: Layout, train: TrainSpec
    ) -> None:
        self.model = model  # parameters live here (DTensor shards under TP/FSDP)
        self.wrapped = wrapped  # what forward calls: a DDP wrapper, or the model itself
        self.model_parts = [model]
        self.mesh = runtime_mesh
        self.layout = layout
        self.train = train
        self.micro_batch = train.micro_batch
        self.is_fsdp = layout.fsdp > 1
        self.is_fsdp_module = isinstance(model, FSDPModule)  # FSDP, HSDP or `replicate`
        self.is_ddp = isinstance(wrapped, DistributedDataParallel)
        # loss and token counts are averaged over every rank that holds the same weights: the
        # ranks with different data (`batch`), and with context parallelism their sequence shards
        replicas = "dp_fsdp_cp" if layout.cp > 1 else "batch"
        self.replicas = runtime_mesh.size(replicas)
        self.replica_group = runtime_mesh.group(replicas) if self.replicas > 1 else None
        self.cp, self.cp_rank = layout.cp, runtime_mesh.coord("cp")
        # bf16: autocast around each forward, or nothing where FSDP2's policy casts the weights
        self.autocast = forward_context(train.dtype, layout, runtime_mesh.device_mesh.device_type)

    # ---- the StepRunner contract

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        chunks = list(zip(inputs.split(self.micro_batch), labels.split(self.micro_batch)))
        scale = 1.0 / len(chunks)
        set_aux_loss_scale(self.model, scale)
        total = torch.zeros((), device=inputs.device)
        for i, (x, y) in enumerate(chunks):
            last = i == len(chunks) - 1
            x, y, positions = self._sequence_shard(x, y)
            with self._sync_context(last), loss_context(self.model):
                with self.autocast:
                    logits = self.wrapped(x, position_ids=positions)
                loss = lm_loss(logits, y)
                (loss * scale).backward()
            total += _plain(loss).detach() * scale
        self._finish_partial_grads()
        return self._mean_over_replicas(total)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = self._global_grad_norm()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                _local(g).mul_(coef.to(_local(g).device))
        return norm

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        losses = []
        for x, y in zip(inputs.split(self.micro_batch), labels.split(self.micro_batch)):
            x, y, positions = self._sequence_shard(x, y)
            with loss_context(self.model), self.autocast:
                losses.append(_plain(lm_loss(self.wrapped(x, position_ids=positions), y)))
        self.model.train(was_training)
        return self._mean_over_replicas(torch.stack(losses).mean())

    # ---- optional hooks the loop calls when present

    def build_optimizer(self, part: nn.Module) -> torch.optim.Optimizer:
        """AdamW for `part` (ZeroRedundancyOptimizer over `dp` with --zero 1)."""
        dp_group = self.mesh.group("dp") if self.mesh.size("dp") > 1 else None
        return make_optimizer(part, self.train, self.layout, dp_group)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """MoE auxiliary-loss-free balancing: nudge the bias with token counts over all replicas."""
        for moe in moe_layers(self.model):
            counts = None
            if moe.bias_rate > 0 and self.replica_group is not None:
                counts = moe.tokens_per_expert.clone()
                dist.all_reduce(counts, group=self.replica_group)
            moe.update_bias(counts)

    # ---- internals

    def _sequence_shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Context parallel: this rank's load-balanced columns of inputs and labels, with their positions."""
        if self.cp == 1:
            return x, y, None
        from fivefold.parallel.context import split_sequence

        x, positions = split_sequence(x, self.cp, self.cp_rank)
        y, _ = split_sequence(y, self.cp, self.cp_rank)
        return x, y, positions

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        if self.is_ddp and not last:
            return self.wrapped.no_sync()
        if self.is_fsdp_module:
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _finish_partial_grads(self) -> None:
        """Give every DTensor gradient its parameter's placements, once per step.

        Replicated weights that see only a sequence shard (SP norms, replicated KV projections)
        get Partial gradients: summed here over `tp`, where the ledger sees the all-reduce.
        The vocabulary-parallel embedding gets a Replicate (full-size) gradient: cut here to its
        shard, locally, so gradient memory is 1/tp as the weight's.
        """
        for p in self.model.parameters():
            grad = p.grad
            if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
                p.grad = grad.redistribute(placements=p.placements)

    def _mean_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().float().clone()
        if self.replica_group is not None:
            dist.all_reduce(value, group=self.replica_group)
            value /= self.replicas
        return value

    def _global_grad_norm(self) -> torch.Tensor:
        """sqrt of the sum of squares over all gradient shards; each shard counted once."""
        device = next(self.model.parameters()).device
        return grad_norm_squared(list(self.model.parameters()), device).sqrt().float()


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
