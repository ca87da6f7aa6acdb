"""The pipelined `StepRunner`: torch's stages and schedules over this rank's chunks.

`build_pipeline_runner` cuts the model into this rank's chunks (the split and placement are
`fivefold.parallel.pipeline`'s), applies the other axes to each chunk and wraps them in torch's
stages; `PipelineRunner` steps them with a torch schedule. Gradient finalisation, clipping, the
optimizer, the MoE bias and the loss average are the shared `RunnerCore`'s; plain dp replicas (no
DDP wrapper around a stage) average their gradients once after the whole schedule.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.tensor import DTensor

from fivefold.config import Layout, TrainSpec
from fivefold.errors import FivefoldError
from fivefold.layout_math import end_ranks
from fivefold.measure.timeline import Timeline
from fivefold.model import materialize
from fivefold.model.moe import set_aux_loss_scale
from fivefold.model.transformer import init_tied_head, lm_loss
from fivefold.parallel.apply import parallelize_chunk
from fivefold.parallel.context import shard_positions
from fivefold.parallel.pipeline import (
    SCHEDULE_CLASSES,
    SINGLE_STAGE,
    _copy_from,
    build_chunk,
    check_pipeline,
    rank_stages,
    stage_to_rank,
)
from fivefold.parallel.precision import precision_mode
from fivefold.parallel.runner_core import RunnerCore, plain


class PipelineRunner(RunnerCore):
    """One rank's chunks of a pipeline, stepped by a torch schedule."""

    def __init__(
        self,
        parts: list[nn.Module],
        modules: list[nn.Module],
        stage_ids: list[int],
        split: list[int],
        runtime_mesh,
        layout: Layout,
        device: torch.device,
        train: TrainSpec | None = None,
    ) -> None:
        super().__init__(runtime_mesh, layout, train or TrainSpec())
        self.model_parts = parts  # the chunks' own modules (a DDP wrapper, if any, is only called)
        self.stage_ids = stage_ids
        self.split = split  # layers per chunk, all chunks
        self.microbatches = layout.microbatches
        self.num_stages = layout.pp * layout.virtual_stages
        self.pp_group = runtime_mesh.group("pp")
        self.timeline = Timeline(rank=dist.get_rank(), pp_rank=runtime_mesh.coord("pp"))
        self.has_first = 0 in stage_ids
        self.has_last = self.num_stages - 1 in stage_ids
        last_pp_rank = stage_to_rank(self.num_stages - 1, layout.pp, layout.pp_schedule)
        self.last_stage_global_rank = dist.get_global_rank(self.pp_group, last_pp_rank)
        self.stages = [
            pipelining.PipelineStage(module, s, self.num_stages, device, group=self.pp_group)
            for module, s in zip(modules, stage_ids)
        ]
        for stage in self.stages:
            self.timeline.instrument(stage)
        schedule_cls = getattr(pipelining, SCHEDULE_CLASSES[layout.pp_schedule])
        m = self.microbatches

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            # the mean over micro-batches, built in: the schedule then leaves gradients unscaled
            return self.loss(logits, labels) / m

        target = self.stages[0] if layout.pp_schedule in SINGLE_STAGE else self.stages
        self.schedule = schedule_cls(target, m, loss_fn=loss_fn, scale_grads=False)
        # plain replicas (no fsdp, no tp): their gradients are averaged by hand after the schedule,
        # over every rank that saw other tokens (other data, other sequence shards)
        plain_replicas = layout.fsdp == 1 and layout.tp == 1
        self.dp_replica_group = self.replica_group if plain_replicas else None
        self.cp, self.cp_rank = layout.cp, runtime_mesh.coord("cp")
        self.tie_group = self._tie_group(parts[0].spec.tie_embeddings)

    # ---- StepRunner
    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._check_batch(inputs)
        inputs, labels = self._sequence_shard(inputs, labels)
        for part in self.model_parts:
            part.train()
            set_aux_loss_scale(part, 1.0 / self.microbatches)
        losses: list[torch.Tensor] = []
        with self.timeline.step(), self._loss_context():
            self._step(inputs, labels, losses, train=True)
        self.finish_gradients()
        self._sum_tied_grads()
        self._average_replica_grads()
        return self._global_loss(losses)

    def counted_once(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """A tied head's gradient equals the embedding's (summed between them): count the weight once."""
        heads = self._tied_heads()
        return [p for p in params if not any(p is h for h in heads)]

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._check_batch(inputs)
        inputs, labels = self._sequence_shard(inputs, labels)
        modes = [part.training for part in self.model_parts]
        for part in self.model_parts:
            part.eval()
        try:
            with self._loss_context():
                losses = self._forward_only(inputs, labels)
        finally:
            for part, mode in zip(self.model_parts, modes):
                part.train(mode)
        return self._global_loss(losses)

    # ---- helpers
    def _step(self, inputs: torch.Tensor, labels: torch.Tensor, losses: list, train: bool) -> None:
        # a batch's inputs and labels are column slices of one token tensor (stride seq + 1): torch
        # 2.11's stages check each micro-batch's strides against the shapes they were built for
        args = (inputs.contiguous(),) if self.has_first else ()
        target = labels.contiguous() if self.has_last else None
        self.schedule.step(
            *args, target=target, losses=losses if self.has_last else None, return_outputs=False
        )

    def _forward_only(self, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """Micro-batch by micro-batch, stage by stage, every rank in the same order: no schedule state.

        (torch's `schedule.eval` cannot run the V-shaped schedules, whose local hand-over between a
        rank's two chunks expects a backward.) Each hand-over sends the shape first, so TP/SP
        chunks whose outputs are shards work too.
        """
        m = self.microbatches
        modules = dict(zip(self.stage_ids, (stage.submod for stage in self.stages)))
        pp, sched = self.layout.pp, self.layout.pp_schedule
        losses, carry = [], None
        for x, y in zip(inputs.chunk(m), labels.chunk(m)):
            for s in range(self.num_stages):
                here, prev = stage_to_rank(s, pp, sched), stage_to_rank(s - 1, pp, sched) if s else -1
                mine = here == self.mesh.coord("pp")
                if s > 0 and here != prev:  # hand over from the previous chunk's rank
                    if mine:
                        carry = _recv_tensor(self.pp_group, prev, self.device())
                    elif prev == self.mesh.coord("pp"):
                        _send_tensor(carry, self.pp_group, here)
                if not mine:
                    continue
                carry = modules[s](x if s == 0 else carry)
                if s == self.num_stages - 1:
                    losses.append(lm_loss(carry, y) / m)
        return losses

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """A vocabulary-sharded head (TP) computes the loss on its shards: `loss_parallel` around the
        schedule, which runs the loss and its backward inside."""
        if self.layout.tp > 1 and self.has_last:
            from fivefold.parallel.tensor import loss_context

            return loss_context(self.model_parts[self.stage_ids.index(self.num_stages - 1)])
        return contextlib.nullcontext()

    def _sequence_shard(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context parallel: this rank's load-balanced columns; each stage adds their positions."""
        if self.cp == 1:
            return inputs, labels
        from fivefold.parallel.context import split_sequence

        return split_sequence(inputs, self.cp, self.cp_rank)[0], split_sequence(
            labels, self.cp, self.cp_rank
        )[0]

    def _tie_group(self, tied: bool):
        """Tied embeddings: the first chunk's embedding and the last chunk's head are copies of one
        weight, kept equal as Megatron does: their gradients summed between the two pp ranks (a
        group of those two per position on the other axes), or locally when one rank holds both."""
        first, last = end_ranks(self.layout)
        if not tied or first == last:
            return None
        pairs = [[g[first], g[last]] for g in self.mesh.info.dims["pp"].groups]
        own, _ = dist.new_subgroups_by_enumeration(pairs)
        if own is not None:  # a middle stage (pp >= 3) holds no copy, is in no pair, and sums nothing
            self.mesh.group_axes[own] = "pp"
        return own

    def _tied_heads(self) -> list[nn.Parameter]:
        if not self.model_parts[0].spec.tie_embeddings:
            return []
        return [part.lm_head.weight for part in self.model_parts if part.lm_head is not None]

    def _sum_tied_grads(self) -> None:
        if not self.model_parts[0].spec.tie_embeddings:
            return
        copies = [
            part.model.embed_tokens.weight for part in self.model_parts if part.model.embed_tokens is not None
        ]
        copies += self._tied_heads()
        grads = []
        for p in copies:
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)
            grads.append(p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad)
        if self.tie_group is not None:
            for g in grads:
                dist.all_reduce(g, group=self.tie_group)
        elif len(grads) == 2:
            total = grads[0] + grads[1]
            for g in grads:
                g.copy_(total)

    def _average_replica_grads(self) -> None:
        """Plain data-parallel replicas: one all-reduce per gradient after the whole schedule
        (expert weights, sharded over ep, are finished by `finish_gradients` instead)."""
        if self.dp_replica_group is None:
            return
        for part in self.model_parts:
            for p in part.parameters():
                if p.grad is not None and not isinstance(p, DTensor):
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=self.dp_replica_group)

    def _check_batch(self, inputs: torch.Tensor) -> None:
        if inputs.shape[0] % self.microbatches:
            raise FivefoldError(
                f"a batch of {inputs.shape[0]} sequences does not divide into --microbatches "
                f"{self.microbatches}; use a batch that is a multiple of {self.microbatches}"
            )

    def _global_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        device = self.device()
        loss = torch.zeros((), device=device, dtype=torch.float32)
        if self.has_last:
            loss = torch.stack([plain(x).detach().float() for x in losses]).sum().to(device)
        dist.broadcast(loss, src=self.last_stage_global_rank, group=self.pp_group)
        return self.mean_over_replicas(loss)

    def device(self) -> torch.device:
        return self.stages[0].device


def _send_tensor(t: torch.Tensor, group, peer: int) -> None:
    t = t.to_local() if hasattr(t, "to_local") else t
    header = torch.tensor(
        [t.dim(), _DTYPES.index(t.dtype), *t.shape] + [0] * (8 - t.dim()), dtype=torch.int64, device=t.device
    )
    dist.send(header, group=group, group_dst=peer)
    dist.send(t.contiguous(), group=group, group_dst=peer)


def _recv_tensor(group, peer: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(10, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=peer)
    ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
    out = torch.empty([int(v) for v in header[2 : 2 + ndim]], dtype=dtype, device=device)
    dist.recv(out, group=group, group_src=peer)
    return out


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def build_pipeline_runner(model, runtime_mesh, layout: Layout, train: TrainSpec):
    """The `StepRunner` for a layout with pp > 1 (see fivefold.parallel.api)."""
    counts = check_pipeline(model.spec, layout, train)
    pp, sched = layout.pp, layout.pp_schedule
    chunks_total = pp * layout.virtual_stages
    starts = [sum(counts[:k]) for k in range(chunks_total)]
    device = _device(runtime_mesh, train)
    pp_rank = runtime_mesh.coord("pp")
    source_is_meta = any(p.is_meta for p in model.parameters())
    parts, modules, stage_ids = [], [], rank_stages(pp_rank, pp, layout.virtual_stages, sched)
    for s in stage_ids:
        chunk = build_chunk(model, range(starts[s], starts[s] + counts[s]), s == 0, s == chunks_total - 1)
        module = _parallelize(chunk, runtime_mesh, layout, train)  # materialises it when it shards
        if any(p.is_meta for p in chunk.parameters()):
            materialize(chunk, device, train.seed)
        if model.spec.tie_embeddings and chunk.lm_head is not None and chunk.model.embed_tokens is None:
            init_tied_head(chunk, train.seed)  # the tied weight's other copy: the first chunk's embedding
        if not source_is_meta:
            _copy_from(chunk, model)
        parts.append(chunk)
        autocast = precision_mode(train.dtype, layout) == "autocast"
        module = _with_autocast(module, device) if autocast else module
        if layout.cp > 1:  # the stage sees this rank's sequence shard: hand it its real positions
            module = _with_positions(module, train.seq_len, layout.cp, runtime_mesh.coord("cp"))
        modules.append(module)
    return PipelineRunner(parts, modules, stage_ids, counts, runtime_mesh, layout, device, train)


def _parallelize(chunk, runtime_mesh, layout: Layout, train: TrainSpec):
    """TP(+SP), EP, CP, recompute and FSDP on one chunk; returns the module the stage calls.

    Plain replicas (dp without fsdp or tp) are not wrapped in DDP, whose reducer does not survive
    the schedules' split backward: the runner averages those gradients after the step.
    """
    return parallelize_chunk(chunk, runtime_mesh, layout, train, ddp=False)


def _with_autocast(module, device):
    """bf16 by autocast (see fivefold.parallel.precision): entered inside the stage's module, so
    the schedule's own forwards (and its shape inference) see bf16 activations."""

    class Autocast(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return self.inner(*args, **kwargs)

    return Autocast(module)


def _with_positions(module, seq_len: int, cp: int, cp_rank: int):
    """Context parallel: every stage's rotary tables and causal masks need the positions of this
    rank's load-balanced columns, which the schedule's single tensor argument cannot carry.

    A forward pre-hook adds them, so the stage keeps calling the module itself: torch's stage only
    skips FSDP's gradient reduce-scatter for all but the last micro-batch when its module is the
    FSDP module, not a wrapper around it."""
    positions = shard_positions(seq_len, cp, cp_rank)

    def add_positions(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0]
        ids = positions.to(x.device).unsqueeze(0).expand(x.shape[0], -1)
        return args, {**kwargs, "position_ids": ids}

    module.register_forward_pre_hook(add_positions, with_kwargs=True)
    return module


def _device(runtime_mesh, train: TrainSpec):
    kind = runtime_mesh.device_mesh.device_type
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)
