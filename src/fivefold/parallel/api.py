"""The contract between the training loop and a parallel layout: a `StepRunner`.

The loop owns data, optimizer, schedule, metrics and checkpoints; a runner owns how one rank's
share of a global batch turns into gradients on its shard of the model. The single-device
runner below is also the reference every parallel layout is tested against.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from fivefold.config import Layout, TrainSpec
from fivefold.model.moe import moe_layers, set_aux_loss_scale
from fivefold.model.transformer import lm_loss
from fivefold.parallel.compile import training_loss
from fivefold.parallel.data import make_optimizer
from fivefold.parallel.precision import forward_context


class StepRunner(Protocol):
    """What the training loop needs from a layout.

    Every runner also has (the parallel ones from `fivefold.parallel.runner_core.RunnerCore`):
      * `build_optimizer(part) -> Optimizer`: the optimizer for one of `model_parts` (the layout's
        choice: ZeroRedundancyOptimizer for `--zero 1`, per-parameter AdamW where DTensors of
        several meshes cannot share fused kernels);
      * `after_optimizer_step()`: per-step updates outside the optimizer (MoE balancing bias from
        token counts summed over replicas).
    """

    #: the modules this rank trains (one per local pipeline chunk); the optimizer and the
    #: checkpoint take their parameters, which may be DTensors
    model_parts: list[nn.Module]

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Accumulate gradients for one optimizer step.

        inputs/labels: this rank's share of the global batch, [grad_accum × micro_batch, seq]
        (already split by the data-parallel coordinate). Returns the mean loss over the *global*
        batch as a detached scalar, the same value on every rank.
        """
        ...

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over all shards and stages; return the norm before
        clipping (max_norm <= 0: only measure)."""
        ...

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean loss over the global held-out batch, the same value on every rank."""
        ...

    def build_optimizer(self, part: nn.Module) -> torch.optim.Optimizer: ...

    def after_optimizer_step(self) -> None: ...


class LocalRunner:
    """One process, one device: micro-batches accumulated in a plain loop."""

    def __init__(self, model: nn.Module, micro_batch: int, train: TrainSpec | None = None) -> None:
        self.model = model
        self.model_parts = [model]
        self.micro_batch = micro_batch
        self.train = train or TrainSpec()
        self.dtype = self.train.dtype  # bf16: autocast around each forward (fivefold.parallel.precision)
        self.loss = training_loss(self.train, Layout())

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        with forward_context(self.dtype, Layout(), x.device.type):
            return self.model(x)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        chunks = list(zip(inputs.split(self.micro_batch), labels.split(self.micro_batch)))
        scale = 1.0 / len(chunks)
        set_aux_loss_scale(self.model, scale)
        total = torch.zeros((), device=inputs.device)
        for x, y in chunks:
            loss = self.loss(self._forward(x), y)
            (loss * scale).backward()
            total += loss.detach() * scale
        return total

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm <= 0:
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def build_optimizer(self, part: nn.Module) -> torch.optim.Optimizer:
        """The same AdamW the parallel runners build, over the whole model."""
        return make_optimizer(part, self.train, Layout(), None)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        for moe in moe_layers(self.model):
            moe.update_bias()

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        losses = [
            lm_loss(self._forward(x), y)
            for x, y in zip(inputs.split(self.micro_batch), labels.split(self.micro_batch))
        ]
        self.model.train(was_training)
        return torch.stack(losses).mean()
