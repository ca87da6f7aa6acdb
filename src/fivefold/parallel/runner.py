"""`ParallelRunner`: the StepRunner for every layout without pipelining.

One optimizer step on this rank: its share of the global batch is split into micro-batches;
gradient synchronisation (DDP's bucketed all-reduce, FSDP's reduce-scatter / HSDP's all-reduce)
runs only on the last one; each micro-batch loss is scaled by 1/accumulation, and the data-parallel
reductions average over replicas, so the gradient is that of the mean loss over the global batch.
Gradient finalisation, clipping, the optimizer, the MoE bias and the loss average are the shared
`RunnerCore`'s.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from fivefold.config import Layout, TrainSpec
from fivefold.model.moe import set_aux_loss_scale
from fivefold.model.transformer import lm_loss
from fivefold.parallel.precision import forward_context, uses_fsdp
from fivefold.parallel.runner_core import RunnerCore, plain
from fivefold.parallel.tensor import loss_context


class ParallelRunner(RunnerCore):
    def __init__(
        self, model: nn.Module, wrapped: nn.Module, runtime_mesh: Any, layout: Layout, train: TrainSpec
    ) -> None:
        super().__init__(runtime_mesh, layout, train)
        self.model = model  # parameters live here (DTensor shards under TP/FSDP)
        self.wrapped = wrapped  # what forward calls: a DDP wrapper, or the model itself
        self.model_parts = [model]
        self.micro_batch = train.micro_batch
        self.is_fsdp = layout.fsdp > 1
        self.is_fsdp_module = isinstance(model, FSDPModule)  # FSDP, HSDP or `replicate`
        self.is_ddp = isinstance(wrapped, DistributedDataParallel)
        self.cp, self.cp_rank = layout.cp, runtime_mesh.coord("cp")
        self.sharded = uses_fsdp(layout)  # FSDP proper, not replicate (FSDP's module over whole weights)
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
                loss = self.loss(logits, y)
                (loss * scale).backward()
            total += plain(loss).detach() * scale
        self.finish_gradients()
        return self.mean_over_replicas(total)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        losses = []
        for x, y in zip(inputs.split(self.micro_batch), labels.split(self.micro_batch)):
            x, y, positions = self._sequence_shard(x, y)
            with loss_context(self.model), self.autocast:
                losses.append(plain(lm_loss(self.wrapped(x, position_ids=positions), y)))
        self.model.train(was_training)
        return self.mean_over_replicas(torch.stack(losses).mean())

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
        # whole gradients (DDP, replicate) are reduced once, after the last micro-batch; sharded ones
        # every micro-batch (as torchtitan does): deferring would keep the whole model's unsharded
        # gradients on every rank until the last one
        if self.is_ddp and not last:
            return self.wrapped.no_sync()
        if self.is_fsdp_module and not self.sharded:
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
