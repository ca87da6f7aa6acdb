"""Compose the axes on one model: tensor (+ sequence) parallel, recompute, then FSDP/HSDP or DDP.

The order matters: TP turns weights into DTensors on the `tp` mesh; recompute wraps whole blocks
(or attention cores) so it must see the TP-ed modules; FSDP then shards those DTensors again on
the data-parallel mesh (2-D DTensors), and DDP replicates whatever is left.

A model built on the meta device is materialised only after sharding, with the model's own
per-parameter seeded init, so every rank's shard equals that slice of the single-process model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fivefold.config import Layout, TrainSpec
from fivefold.model.transformer import materialize
from fivefold.parallel.compile import compile_blocks
from fivefold.parallel.context import apply_context_parallel
from fivefold.parallel.data import apply_ddp, apply_fsdp, apply_replicate
from fivefold.parallel.expert import apply_expert_parallel, shard_experts
from fivefold.parallel.precision import mp_policy, uses_fsdp, uses_replicate
from fivefold.parallel.recompute import apply_recompute
from fivefold.parallel.tensor import apply_tensor_parallel


def replica_dim(layout: Layout) -> str:
    """The mesh dim DDP averages over when nothing is sharded: every rank holding the same weights."""
    return "dp_fsdp_cp" if layout.cp > 1 else "dp"


def parallelize_chunk(
    module: nn.Module, runtime_mesh: Any, layout: Layout, train: TrainSpec, ddp: bool = True
) -> nn.Module:
    """Apply TP(+SP), EP, CP, recompute and FSDP/HSDP/DDP to one model chunk (a Transformer, maybe partial).

    Returns the module to call: a DDP wrapper around `module` for replicated data parallelism
    without TP (unless `ddp` is False: pipeline stages average plain replicas themselves), else
    `module` itself (TP, FSDP and `replicate` work in place). The parameters are always those of
    `module`.
    """
    spec = module.spec
    on_meta = any(p.is_meta for p in module.parameters())
    if layout.tp > 1:
        apply_tensor_parallel(module, runtime_mesh.get("tp"), spec, layout.sp)
    expert_params = None
    if layout.ep > 1:  # experts sharded over ep, left out of the model's FSDP
        expert_params = set(apply_expert_parallel(module, runtime_mesh))
    if layout.cp > 1:  # tp shards the heads, cp the sequence: the cp core sees this rank's heads
        apply_context_parallel(module, runtime_mesh.group("cp"), layout.cp, layout.cp_impl)
    if layout.recompute != "none":
        apply_recompute(module, layout.recompute, layout.recompute_layers)
    if train.compile:  # after TP and recompute, before FSDP wraps the blocks
        compile_blocks(module)
    device = torch.device(runtime_mesh.device_mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if uses_fsdp(layout):
        if expert_params and runtime_mesh.size("expert_fsdp") > 1:  # experts: FSDP on their own mesh
            shard_experts(module, runtime_mesh, layout.zero, mp_policy(train.dtype))
            expert_params = None
        mesh = runtime_mesh.get("fsdp_cp") if layout.dp == 1 else runtime_mesh.submesh("dp", "fsdp_cp")
        apply_fsdp(module, mesh, layout.zero, train, ignored=expert_params)
        if on_meta:
            materialize(module, device, train.seed)
        return module
    replicas = replica_dim(layout)
    if runtime_mesh.size(replicas) > 1 and uses_replicate(layout):
        apply_replicate(module, runtime_mesh.get(replicas), train, ignored=expert_params)
    if on_meta:
        materialize(module, device, train.seed)
    if runtime_mesh.size(replicas) > 1 and layout.tp == 1 and ddp:
        return apply_ddp(module, runtime_mesh.group(replicas), ignored=expert_params)
    return module
