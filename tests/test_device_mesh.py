"""The torch DeviceMesh's process groups equal the pure-Python mesh groups, for every order.

The reference is `fivefold.mesh` (itself checked against brute force in test_mesh.py); here the
question is whether torch's groups, local ranks and flattened/unflattened dims agree with it.
World 16 runs every rank in this process on torch's fake backend; world 8 also runs on real
gloo ranks.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch.distributed as dist

from distributed import run_distributed
from fivefold.config import AXES, Layout
from fivefold.mesh import build_mesh

ORDERS = [",".join(p) for p in itertools.permutations(AXES)]
DIMS = AXES + ("ep", "expert_fsdp", "fsdp_cp", "batch", "dp_fsdp_cp")


def _layout(world: int, index: int, order: str) -> Layout:
    """A layout of `world` whose size-1 axes rotate with `index`, with EP where fsdp×cp allows."""
    sizes = dict.fromkeys(AXES, 2)
    ones = 5 - {8: 3, 16: 4}[world]
    for k in range(ones):
        sizes[AXES[(index + 2 * k) % 5]] = 1
    ep = 2 if (sizes["fsdp"] * sizes["cp"]) % 2 == 0 else 1
    return Layout(**sizes, ep=ep, order=order)


def _check_rank(rank: int, layout: Layout, gpus_per_node: int) -> list[str]:
    from fivefold.parallel.device_mesh import build_runtime_mesh

    rm = build_runtime_mesh(layout, gpus_per_node=gpus_per_node)
    want = build_mesh(layout, dist.get_world_size(), gpus_per_node)
    errors = []
    for name in DIMS:
        mesh = rm.get(name)
        got = dist.get_process_group_ranks(mesh.get_group())
        if got != want.group_of(rank, name):
            errors.append(f"{layout.order} {name}: torch {got} != mesh {want.group_of(rank, name)}")
        if mesh.get_local_rank() != want.ranks[rank].coords[name]:
            errors.append(f"{layout.order} {name}: local rank {mesh.get_local_rank()} != coordinate")
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("world", [8, 16])
def test_fake_backend_groups_equal_mesh_groups_for_every_order(world):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    errors: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index, order in enumerate(ORDERS):
            layout = _layout(world, index, order)
            # four ranks per order, rotating so that every rank is checked across the orders
            for rank in range(index % (world // 4), world, world // 4):
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
                try:
                    errors += _check_rank(rank, layout, 4)
                finally:
                    dist.destroy_process_group()
    assert not errors, errors[:5]


def _gloo_body(rank: int, world: int, orders: list[str]) -> list[str]:
    warnings.simplefilter("ignore")
    errors = []
    for order in orders:
        errors += _check_rank(rank, _layout(world, ORDERS.index(order), order), 4)
        for pg in list(dist.distributed_c10d._world.pg_names):  # free the groups before the next mesh
            if pg is not dist.group.WORLD:
                dist.destroy_process_group(pg)
    return errors


@pytest.mark.slow
def test_gloo_groups_equal_mesh_groups():
    # real gloo groups are slow to create on a small machine: every 12th order, covering each axis
    # innermost and outermost and non-adjacent fsdp/cp
    orders = ORDERS[::12]
    results = run_distributed(_gloo_body, 8, orders, timeout=300)
    assert all(not errs for errs in results), [e for errs in results for e in errs][:5]


def test_runtime_mesh_needs_a_process_group():
    from fivefold.errors import FivefoldError
    from fivefold.parallel.device_mesh import build_runtime_mesh

    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    with pytest.raises(FivefoldError, match="process group"):
        build_runtime_mesh(Layout())
