"""The pipelined `StepRunner`: torch's stages and schedules over this rank's chunks.

Built by `fivefold.parallel.pipeline.build_pipeline_runner`; see that module for the split and the
rules on losses and gradient scaling.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from fivefold.config import Layout
from fivefold.errors import FivefoldError
from fivefold.model.moe import set_aux_loss_scale
from fivefold.model.transformer import lm_loss
from fivefold.parallel.pipeline import SCHEDULE_CLASSES, SINGLE_STAGE, stage_to_rank
from fivefold.parallel.timeline import Timeline


class PipelineRunner:
    """One rank's chunks of a pipeline, stepped by a torch schedule."""

    def __init__(self, parts: list[nn.Module], stage_ids: list[int], split: list[int], runtime_mesh,
                 layout: Layout, device: torch.device) -> None:
        self.model_parts = parts
        self.stage_ids = stage_ids
        self.split = split  # layers per chunk, all chunks
        self.layout = layout
        self.mesh = runtime_mesh
        self.microbatches = layout.microbatches
        self.num_stages = layout.pp * layout.virtual_stages
        self.pp_group = runtime_mesh.group("pp")
        self.timeline = Timeline(rank=dist.get_rank(), pp_rank=runtime_mesh.coord("pp"))
        self.has_first = 0 in stage_ids
        self.has_last = self.num_stages - 1 in stage_ids
        last_pp_rank = stage_to_rank(self.num_stages - 1, layout.pp, layout.pp_schedule)
        self.last_stage_global_rank = dist.get_global_rank(self.pp_group, last_pp_rank)
        self.stages = [
            pipelining.PipelineStage(part, s, self.num_stages, device, group=self.pp_group)
            for part, s in zip(parts, stage_ids)
        ]
        for stage in self.stages:
            self.timeline.instrument(stage)
        schedule_cls = getattr(pipelining, SCHEDULE_CLASSES[layout.pp_schedule])
        m = self.microbatches

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            # the mean over micro-batches, built in: the schedule then leaves gradients unscaled
            return lm_loss(logits, labels) / m

        target = self.stages[0] if layout.pp_schedule in SINGLE_STAGE else self.stages
        self.schedule = schedule_cls(target, m, loss_fn=loss_fn, scale_grads=False)
        batch_size = runtime_mesh.size("batch")
        self.batch_group = runtime_mesh.group("batch") if batch_size > 1 else None

    # ---- StepRunner
    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._check_batch(inputs)
        for part in self.model_parts:
            part.train()
            set_aux_loss_scale(part, 1.0 / self.microbatches)
        losses: list[torch.Tensor] = []
        with self.timeline.step():
            self._step(inputs, labels, losses, train=True)
        return self._global_loss(losses)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for part in self.model_parts for p in part.parameters() if p.grad is not None]
        squares = _local_grad_norm_squared(params, self._device())
        dist.all_reduce(squares, group=self.pp_group)  # the stages hold disjoint parameters
        total = squares.sqrt()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._check_batch(inputs)
        modes = [part.training for part in self.model_parts]
        for part in self.model_parts:
            part.eval()
        losses: list[torch.Tensor] = []
        try:
            self._step(inputs, labels, losses, train=False)
        finally:
            for part, mode in zip(self.model_parts, modes):
                part.train(mode)
        return self._global_loss(losses)

    # ---- helpers
    def _step(self, inputs: torch.Tensor, labels: torch.Tensor, losses: list, train: bool) -> None:
        args = (inputs,) if self.has_first else ()
        target = labels if self.has_last else None
        run = self.schedule.step if train else self.schedule.eval
        kwargs = {"return_outputs": False} if train else {}
        run(*args, target=target, losses=losses if self.has_last else None, **kwargs)

    def _check_batch(self, inputs: torch.Tensor) -> None:
        if inputs.shape[0] % self.microbatches:
            raise FivefoldError(
                f"a batch of {inputs.shape[0]} sequences does not divide into --microbatches "
                f"{self.microbatches}; use a batch that is a multiple of {self.microbatches}"
            )

    def _global_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        device = self._device()
        loss = torch.zeros((), device=device, dtype=torch.float32)
        if self.has_last:
            loss = torch.stack([x.detach().float() for x in losses]).sum().to(device)
        dist.broadcast(loss, src=self.last_stage_global_rank, group=self.pp_group)
        if self.batch_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.batch_group)
        return loss

    def _device(self) -> torch.device:
        return self.stages[0].device


def _local_grad_norm_squared(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared gradient entries this pp rank owns, full over any DTensor shards.

    DTensor gradients are grouped by mesh: the norm of a sharded DTensor is reduced over its own
    mesh (fsdp, tp) when made full; plain tensors are local.
    """
    total = torch.zeros((), device=device, dtype=torch.float32)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = getattr(p.grad, "device_mesh", None)
        groups.setdefault(key, []).append(p.grad)
    for mesh, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=None)
        if mesh is not None:
            norm = norm.full_tensor()
        total = total + norm.float().to(device) ** 2
    return total
