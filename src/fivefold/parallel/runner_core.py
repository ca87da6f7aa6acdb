"""What every parallel runner does after its micro-batches have run, written once.

`ParallelRunner` (no pipeline) and `PipelineRunner` differ only in how one step's micro-batches
turn into gradients. Everything after that is here and shared:
  * gradient finalisation: DTensor gradients whose placements differ from their parameter's
    (Partial sums of SP's replicated norms, the vocabulary-parallel embedding's full-size
    Replicate gradient) are given the parameter's placements, once per step; expert gradients
    are averaged over the replicas FSDP does not reduce;
  * clipping by the global norm over every mesh dim, the pipeline's stages included (one routine
    that takes the pp group, as torch's `clip_grad_norm_` would need one for a DTensor model);
  * the optimizer (AdamW, ZeRO-1 over plain dp replicas with --zero 1);
  * the MoE balancing bias, nudged with token counts summed over every rank that saw other tokens;
  * the step's loss, averaged over those same ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fivefold.config import Layout, TrainSpec
from fivefold.model.moe import moe_layers
from fivefold.parallel.compile import training_loss
from fivefold.parallel.data import make_optimizer
from fivefold.parallel.expert import reduce_expert_replicas
from fivefold.parallel.gradnorm import grad_norm_squared


class RunnerCore:
    model_parts: list[nn.Module]

    def __init__(self, runtime_mesh: Any, layout: Layout, train: TrainSpec) -> None:
        self.mesh = runtime_mesh
        self.layout = layout
        self.train = train
        # ranks that hold the same weights but other tokens: the data ranks (`batch`), and with
        # context parallelism their sequence shards too
        replicas = "dp_fsdp_cp" if layout.cp > 1 else "batch"
        self.replicas = runtime_mesh.size(replicas)
        self.replica_group = runtime_mesh.group(replicas) if self.replicas > 1 else None
        self.pp_group = runtime_mesh.group("pp") if layout.pp > 1 else None
        # this layout's group of every mesh dim, by name: the grad norm reduces over these
        self.mesh_groups = {name: runtime_mesh.group(name) for name in runtime_mesh.meshes}
        self.loss = training_loss(train, layout)  # what a training step's backward starts from

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters()]

    def finish_gradients(self) -> None:
        """Give every DTensor gradient its parameter's placements: Partial sums reduced over `tp`
        (where the ledger sees the all-reduce), full-size gradients of sharded weights cut locally
        to their shard so that gradient memory is the weight's. Expert weights: the average over
        the replicas of the same experts that neither FSDP nor DDP reduce (see
        `fivefold.parallel.expert.reduce_expert_replicas`)."""
        for p in self.parameters():
            grad = p.grad
            if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
                p.grad = grad.redistribute(placements=p.placements)
        if self.layout.ep > 1:
            for part in self.model_parts:
                reduce_expert_replicas(part, self.mesh)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so that their global norm is at most `max_norm` (<= 0: only measure) and
        return the norm before clipping: squares over every shard (fivefold.parallel.gradnorm),
        summed over the pipeline's stages, which hold disjoint parameters."""
        params = [p for p in self.parameters() if p.grad is not None]
        squares = grad_norm_squared(self.counted_once(params), self.device(), self.mesh_groups)
        if self.pp_group is not None:
            dist.all_reduce(squares, group=self.pp_group)
        norm = squares.sqrt().float()
        if max_norm > 0:
            # torch's rule and precision (clip_grad_norm_): an fp32 factor max_norm / (norm + 1e-6), at most 1
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                _local(p.grad).mul_(coef.to(_local(p.grad).device))
        return norm

    def counted_once(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters whose gradients enter the norm (a runner holding two copies of one weight
        leaves one out)."""
        return params

    def build_optimizer(self, part: nn.Module) -> torch.optim.Optimizer:
        """AdamW for `part` (ZeroRedundancyOptimizer over `dp` with --zero 1)."""
        dp_group = self.mesh.group("dp") if self.mesh.size("dp") > 1 else None
        return make_optimizer(part, self.train, self.layout, dp_group)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """MoE auxiliary-loss-free balancing: nudge each router's bias with its token counts summed
        over the ranks that routed other tokens."""
        for part in self.model_parts:
            for moe in moe_layers(part):
                counts = None
                if moe.bias_rate > 0 and self.replica_group is not None:
                    counts = moe.tokens_per_expert.clone()
                    dist.all_reduce(counts, group=self.replica_group)
                moe.update_bias(counts)

    def mean_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """A per-rank mean loss made the global batch's, the same on every rank."""
        value = value.detach().float().clone()
        if self.replica_group is not None:
            dist.all_reduce(value, group=self.replica_group)
            value /= self.replicas
        return value

    def device(self) -> torch.device:
        return next(p for p in self.parameters()).device


def plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (a loss under loss_parallel) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
