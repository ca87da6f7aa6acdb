"""Data and sharded-data parallelism: DDP (+ ZeRO-1), FSDP2 per block (ZeRO-2/3), HSDP.

* `dp` only: torch DDP, gradients all-reduced in buckets while the backward still runs. With
  tensor parallelism underneath, the DTensor parameters are handed to DDP as their local shards
  (`_pre_dp_module_transform`), so each shard is averaged over its own data-parallel replicas.
* `--zero 1`: the same DDP plus `ZeroRedundancyOptimizer`: each replica keeps the AdamW state of
  its share of the parameters, steps only those, and broadcasts them to the other replicas.
* `fsdp` (> 1): FSDP2 `fully_shard` on each block, on the embedding, on the final norm + head
  together, then on the root. Parameters, gradients and optimizer state are 1/N per rank (dim 0,
  padded up to a multiple of N). `--zero 2` keeps a block's gathered parameters from forward to
  backward; `--zero 3` re-shards after forward and gathers again in backward.
* `dp × fsdp`: HSDP, the same calls on the 2-D (dp, fsdp_cp) mesh: shard inside a replica group,
  all-reduce the reduced-scattered shard across replicas.
* bf16: FSDP2's MixedPrecisionPolicy computes in bf16 from fp32 master weights and reduces
  gradients in fp32. (Without FSDP the runner uses autocast instead.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fivefold.config import Layout, TrainSpec


def mixed_precision(train: TrainSpec) -> MixedPrecisionPolicy:
    if train.dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, zero: int, train: TrainSpec) -> None:
    """FSDP2 units: each block, the embedding, norm + head, then the root (in place).

    `mesh` is 1-D (fsdp_cp) for FSDP or 2-D (dp, fsdp_cp) for HSDP.
    """
    policy = mixed_precision(train)
    reshard = zero == 3
    decoder = model.model
    if decoder.embed_tokens is not None:
        fully_shard(decoder.embed_tokens, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    for block in decoder.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    tail = [m for m in (decoder.norm, model.lm_head) if m is not None]
    if tail:
        fully_shard(tail, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    # the root owns no parameters of its own; it drives the units (prefetch, final reduce wait)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)


def apply_ddp(model: nn.Module, group: torch.distributed.ProcessGroup) -> DistributedDataParallel:
    """Wrap in DDP over `group`; tensor-parallel DTensor parameters go in as their local shards."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        model._dtensor_specs = {  # the clip-norm needs to know which local tensors are shards
            name: (p.device_mesh, p.placements) for name, p in model.named_parameters()
            if isinstance(p, DTensor)
        }
        _pre_dp_module_transform(model)
    # buffers are deterministic (rotary tables) or per-rank statistics (MoE token counts): no broadcast
    return DistributedDataParallel(model, process_group=group, broadcast_buffers=False)


def make_optimizer(
    module: nn.Module, train: TrainSpec, layout: Layout, dp_group: torch.distributed.ProcessGroup | None
) -> torch.optim.Optimizer:
    """AdamW (decay on matrices only, as the training loop's own); with `--zero 1`, sharded over dp."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    hyper = dict(lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps)
    # foreach kernels take one kind of tensor per list: DTensors on different meshes (TP, FSDP,
    # plain MoE experts under TP) do not mix, so those layouts step parameter by parameter
    foreach = len({_mesh_key(p) for p in params}) == 1
    if layout.zero == 1 and layout.dp > 1 and layout.fsdp == 1 and dp_group is not None:
        return _zero_with_groups(groups, dp_group, foreach, hyper)
    return torch.optim.AdamW(groups, foreach=foreach, **hyper)


def _zero_with_groups(groups: list[dict], dp_group: torch.distributed.ProcessGroup, foreach: bool,
                      hyper: dict) -> ZeroRedundancyOptimizer:
    zero = ZeroRedundancyOptimizer(
        groups[0]["params"], optimizer_class=torch.optim.AdamW, process_group=dp_group, foreach=foreach,
        weight_decay=groups[0]["weight_decay"], **hyper,
    )
    for group in groups[1:]:
        zero.add_param_group(group)
    return zero


def _mesh_key(p: torch.Tensor) -> object:
    return p.device_mesh if isinstance(p, DTensor) else None
