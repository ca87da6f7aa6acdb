"""The private torch APIs fivefold needs exist on the installed torch and do what it relies on."""

from __future__ import annotations

import pytest
import torch

from fivefold import torch_internals
from fivefold.errors import FivefoldError


def test_every_internal_is_present_on_this_torch() -> None:
    assert torch_internals.missing() == []
    torch_internals.check()


def test_a_missing_internal_is_named_in_one_error(monkeypatch) -> None:
    from torch.distributed.pipelining import schedules

    monkeypatch.delattr(schedules, "_batch_p2p")
    with pytest.raises(FivefoldError, match="pipelining.schedules._batch_p2p"):
        torch_internals.check()


def test_raw_call_and_below_autograd_run_the_real_kernel() -> None:
    a, b = torch.ones(3, requires_grad=True), torch.full((3,), 2.0)
    with torch_internals.below_autograd():
        out = torch_internals.raw_call(torch.ops.aten.add.Tensor)(a, b)
    assert torch.equal(out, torch.full((3,), 3.0)) and out.grad_fn is None


def test_a_library_kernel_is_removed_again() -> None:
    calls = []
    lib = torch.library.Library("aten", "IMPL")
    call = torch_internals.raw_call(torch.ops.aten.sub.Tensor)

    def kernel(*args, **kwargs):
        calls.append(1)
        with torch_internals.below_autograd():
            return call(*args, **kwargs)

    lib.impl("sub.Tensor", kernel, "ADInplaceOrView")
    torch.ones(2, requires_grad=True) - torch.ones(2)
    torch_internals.destroy_library(lib)
    torch.ones(2, requires_grad=True) - torch.ones(2)
    assert calls == [1]


def test_pipeline_p2p_routes_and_restores() -> None:
    from torch.distributed.pipelining import schedules

    before = schedules._batch_p2p, schedules._wait_batch_p2p
    seen = []
    with torch_internals.pipeline_p2p(
        lambda post, ops, desc: seen.append(("post", ops, desc)) or [],
        lambda wait, works: seen.append("wait"),
    ):
        schedules._batch_p2p([], "x")
        schedules._wait_batch_p2p([])
    assert seen == [("post", [], "x"), "wait"]
    assert (schedules._batch_p2p, schedules._wait_batch_p2p) == before


def test_group_names_and_mesh_reshaping_on_one_rank(tmp_path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
        flat = torch_internals.flatten_mesh(mesh[("a", "b")], "ab")
        split = torch_internals.unflatten_mesh(flat, 0, (1, 1), ("c", "d"))
        assert flat.mesh_dim_names == ("ab",) and split.mesh_dim_names == ("c", "d")
        group = flat.get_group()
        name = torch_internals.group_name(group)
        assert name == group.group_name
        assert torch_internals.process_group_named(name) is not None
        assert torch_internals.process_group_named("no such group") is None
    finally:
        dist.destroy_process_group()
