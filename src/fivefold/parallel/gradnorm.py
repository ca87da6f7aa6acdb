"""The global gradient norm over shards: each element counted exactly once, whatever the layout."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist


def grad_norm_squared(
    params: list[torch.Tensor],
    device: torch.device,
    mesh_groups: Mapping[str, dist.ProcessGroup] | None = None,
) -> torch.Tensor:
    """Sum of squared gradient entries of `params`, complete over their DTensor shards (fp64).

    Each DTensor gradient's local squares are summed over the mesh dims it is sharded on (a partial
    sum is made whole first); replicated dims are counted once. Gradients on the same set of groups
    are added locally first, so there is one all-reduce per distinct sharding, not per parameter.
    Axes no DTensor knows about (pipeline stages, plain data replicas) are the caller's to reduce.

    `mesh_groups` (dim name -> this run's group) replaces a DTensor dim's group with this run's
    group of the same name and ranks. A gradient may carry a mesh built for an earlier layout of
    the same process (torch reuses a cached, equal mesh), whose group the ledger cannot name.
    """
    from torch.distributed.tensor import DTensor, Replicate

    by_groups: dict[tuple, torch.Tensor] = {}
    # keyed by the groups' ranks: DTensors of one sharding may carry distinct mesh objects (and
    # group handles) for the same ranks, e.g. experts on `ep` where ep spans all of fsdp, and those
    # must still share one reduction; the first group seen for a set of ranks carries it
    by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        groups: tuple = ()
        if isinstance(grad, DTensor):
            if any(pl.is_partial() for pl in grad.placements):
                grad = grad.redistribute(placements=[Replicate()] * len(grad.placements))
            mesh = grad.device_mesh
            for i, pl in enumerate(grad.placements):
                if not isinstance(pl, Replicate) and mesh.size(i) > 1:
                    group = mesh.get_group(i)
                    ranks = tuple(dist.get_process_group_ranks(group))
                    own = _named_group(mesh_groups, mesh.mesh_dim_names, i, ranks)
                    group = own if own is not None else group
                    by_ranks.setdefault(ranks, group)
                    groups += (ranks,)
            grad = grad.to_local()
        square = grad.detach().double().pow(2).sum().to(device)
        by_groups[groups] = by_groups[groups] + square if groups in by_groups else square
    total = torch.zeros((), dtype=torch.float64, device=device)
    for groups, square in by_groups.items():
        for ranks in groups:
            dist.all_reduce(square, group=by_ranks[ranks])
        total += square
    return total


def _named_group(
    mesh_groups: Mapping[str, dist.ProcessGroup] | None,
    dim_names: tuple[str, ...] | None,
    dim: int,
    ranks: tuple[int, ...],
) -> dist.ProcessGroup | None:
    """This run's group for mesh dim `dim`, when it has one of that name over the same ranks."""
    if not mesh_groups or not dim_names:
        return None
    group = mesh_groups.get(dim_names[dim])
    if group is None or tuple(dist.get_process_group_ranks(group)) != ranks:
        return None
    return group
