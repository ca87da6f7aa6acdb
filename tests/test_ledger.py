"""The comm ledger on a 2×2×2 gloo mesh: each collective lands on its axis with the exact bytes."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from distributed import run_distributed
from fivefold.measure import comm_hooks
from fivefold.measure.ledger import METHODS, CommLedger, wire_bytes

F32 = 4


def test_ring_formulas():
    assert wire_bytes("all_reduce", 800, 4) == 2 * 3 / 4 * 800
    assert wire_bytes("all_gather", 800, 4) == 3 / 4 * 800
    assert wire_bytes("reduce_scatter", 800, 8) == 7 / 8 * 800
    assert wire_bytes("all_to_all", 800, 2) == 400
    assert wire_bytes("send", 800, 2) == wire_bytes("recv", 800, 2) == 800
    assert wire_bytes("all_reduce", 800, 1) == 0


def test_steps_and_summary_without_a_mesh(tmp_path):
    ledger = CommLedger(rank=0)
    ledger.record("tp", "all_reduce", 100, 2)
    ledger.record("tp", "all_reduce", 100, 2)
    ledger.next_step()
    ledger.record("tp", "all_reduce", 300, 2)
    ledger.record("pp", "send", 10, 2)
    ledger.next_step()
    steps = ledger.per_step()
    assert len(steps) == 2
    assert steps[0] == [{"axis": "tp", "op": "all_reduce", "count": 2, "bytes": 200, "wire_bytes": 200.0}]
    summary = {(r["axis"], r["op"]): r for r in ledger.summary()}
    assert summary["tp", "all_reduce"]["bytes"] == 250 and summary["tp", "all_reduce"]["count"] == 1.5
    assert summary["pp", "send"]["wire_bytes"] == 5
    data = json.loads(ledger.write(tmp_path).read_text())
    assert (tmp_path / "ledger.json").exists() and data["steps"] == 2
    # warm-up steps left out of the summary, but never the last step
    assert {(r["axis"], r["op"]): r["count"] for r in ledger.summary(skip=1)} == {
        ("tp", "all_reduce"): 1,
        ("pp", "send"): 1,
    }
    assert ledger.summary(skip=5) == ledger.summary(skip=1)
    data = json.loads(ledger.write(tmp_path, skip=2).read_text())
    assert data["summary_skips"] == 1 and data["summary"] == ledger.summary(skip=1)


def _ops(ledger: CommLedger) -> dict[tuple[str, str], tuple[int, int, float]]:
    rows = ledger.per_step()[-1] if ledger.per_step() else []
    return {(r["axis"], r["op"]): (r["count"], r["bytes"], r["wire_bytes"]) for r in rows}


def _body(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from fivefold.config import Layout
    from fivefold.parallel.device_mesh import build_runtime_mesh

    warnings.simplefilter("ignore")
    mesh_a = build_runtime_mesh(Layout(tp=2, fsdp=2, pp=2, ep=2), gpus_per_node=4)
    mesh_b = build_runtime_mesh(Layout(dp=2, cp=2, tp=2), gpus_per_node=4)
    out = {method: _scenarios(mesh_a, mesh_b, method) for method in METHODS}
    out["hooks_left_installed"] = comm_hooks.installed()
    out["groups"] = {a: dist.get_process_group_ranks(mesh_a.group(a)) for a in ("tp", "fsdp", "pp", "ep")}
    out["groups"] |= {f"b_{a}": dist.get_process_group_ranks(mesh_b.group(a)) for a in ("dp", "cp")}
    return out


def _scenarios(rm, rm_b, method: str) -> dict:
    """rm: tp 2 × fsdp 2 × pp 2 with ep 2; rm_b: tp 2 × cp 2 × dp 2."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    out: dict = {}

    def measure(label, fn, mesh=rm):
        ledger = CommLedger(mesh, method=method)
        with ledger:
            fn()
        out[label] = _ops(ledger)

    # a known collective on each axis
    measure("tp_all_reduce", lambda: dist.all_reduce(torch.ones(10), group=rm.group("tp")))
    measure(
        "fsdp_all_gather",
        lambda: dist.all_gather_into_tensor(torch.empty(6), torch.ones(3), group=rm.group("fsdp")),
    )
    measure(
        "fsdp_reduce_scatter",
        lambda: dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8), group=rm.group("fsdp")),
    )
    measure(
        "ep_all_to_all", lambda: dist.all_to_all_single(torch.empty(6), torch.ones(6), group=rm.group("ep"))
    )

    def dispatch_and_combine():  # an expert-parallel all-to-all with autograd, there and back
        tokens = torch.ones(4, 3, requires_grad=True)
        there = funcol.all_to_all_single_autograd(tokens, None, None, rm.group("ep"))
        back = funcol.all_to_all_single_autograd(there * 2, None, None, rm.group("ep"))
        funcol.wait_tensor(back).sum().backward()

    measure("ep_autograd_all_to_all", dispatch_and_combine)
    measure(
        "cp_all_gather",
        lambda: dist.all_gather_into_tensor(torch.empty(8), torch.ones(4), group=rm_b.group("cp")),
        rm_b,
    )
    pp_peer = dist.get_process_group_ranks(rm.group("pp"))[1 - rm.coord("pp")]

    def send_recv():
        if rm.coord("pp") == 0:
            dist.send(torch.ones(5), pp_peer)
        else:
            dist.recv(torch.empty(5), pp_peer)

    measure("pp_send_recv", send_recv)

    def batched():
        ops = [
            dist.P2POp(dist.isend, torch.ones(7), pp_peer),
            dist.P2POp(dist.irecv, torch.empty(7), pp_peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    measure("pp_batched", batched)

    # FSDP2 over the fsdp mesh: gather each layer once in forward, reduce-scatter its grads
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    for layer in model:
        fully_shard(layer, mesh=rm.get("fsdp_cp"), reshard_after_forward=False)
    fully_shard(model, mesh=rm.get("fsdp_cp"), reshard_after_forward=False)
    measure("fsdp2_step", lambda: model(torch.ones(3, 4)).sum().backward())

    # DTensor TP: column-wise then row-wise; the row-wise output is all-reduced once
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    parallelize_module(mlp, rm.get("tp"), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    measure("tp_dtensor", lambda: mlp(torch.ones(3, 4)).sum().backward())

    # DDP over dp: one bucket, its gradients all-reduced once in backward
    ddp = DistributedDataParallel(nn.Linear(4, 5), process_group=rm_b.group("dp"))
    measure("dp_ddp", lambda: ddp(torch.ones(2, 4)).sum().backward(), rm_b)
    return out


@pytest.mark.slow
def test_ledger_on_a_gloo_mesh():
    results = run_distributed(_body, 8, timeout=240)
    for rank, res in enumerate(results):
        # mesh a: tp 2, fsdp 2, pp 2 in the default order: tp stride 1, fsdp stride 2, pp stride 4
        assert res["groups"]["tp"] == sorted([rank, rank ^ 1])
        assert res["groups"]["fsdp"] == sorted([rank, rank ^ 2])
        assert res["groups"]["pp"] == sorted([rank, rank ^ 4])
        assert res["groups"]["ep"] == res["groups"]["fsdp"]  # ep folds onto fsdp (cp = 1)
        # mesh b: tp 2, cp 2, dp 2: cp stride 2, dp stride 4
        assert res["groups"]["b_cp"] == sorted([rank, rank ^ 2])
        assert res["groups"]["b_dp"] == sorted([rank, rank ^ 4])
        for method in METHODS:
            _check(rank, res[method])
        assert res["hooks"] == res["dispatch"]
        assert not res["hooks_left_installed"]  # nothing stays in the path after the last ledger


def _check(rank: int, res: dict) -> None:
    assert res["tp_all_reduce"] == {("tp", "all_reduce"): (1, 10 * F32, 2 * (2 - 1) / 2 * 10 * F32)}
    assert res["fsdp_all_gather"] == {("fsdp", "all_gather"): (1, 6 * F32, 6 * F32 / 2)}
    assert res["fsdp_reduce_scatter"] == {("fsdp", "reduce_scatter"): (1, 8 * F32, 8 * F32 / 2)}
    # same ranks as fsdp, but its own process group: credited to ep
    assert res["ep_all_to_all"] == {("ep", "all_to_all"): (1, 6 * F32, 6 * F32 / 2)}
    # forward there and back, and the backward of each: four all-to-alls of 4×3 floats
    assert res["ep_autograd_all_to_all"] == {("ep", "all_to_all"): (4, 4 * 12 * F32, 4 * 12 * F32 / 2)}
    assert res["cp_all_gather"] == {("cp", "all_gather"): (1, 8 * F32, 8 * F32 / 2)}
    op = "send" if rank < 4 else "recv"  # first pipeline stage: ranks 0-3
    assert res["pp_send_recv"] == {("pp", op): (1, 5 * F32, 5 * F32)}
    both = {("pp", "send"): (1, 7 * F32, 7 * F32), ("pp", "recv"): (1, 7 * F32, 7 * F32)}
    assert res["pp_batched"] == both
    params = (4 * 6 + 6) + (6 * 4 + 4)  # full parameter count of the two layers
    fsdp = res["fsdp2_step"]
    assert fsdp[("fsdp", "all_gather")] == (2, params * F32, params * F32 / 2)
    assert fsdp[("fsdp", "reduce_scatter")] == (2, params * F32, params * F32 / 2)
    assert set(fsdp) == {("fsdp", "all_gather"), ("fsdp", "reduce_scatter")}
    assert res["tp_dtensor"] == {("tp", "all_reduce"): (1, 3 * 4 * F32, 3 * 4 * F32)}
    ddp_grads = 4 * 5 + 5
    assert res["dp_ddp"] == {("dp", "all_reduce"): (1, ddp_grads * F32, ddp_grads * F32)}


def test_expert_shard_group_is_named_as_fsdp_without_expert_parallelism() -> None:
    """With ep = 1 the experts' shard group is the fsdp×cp group: the ledger must not call it expert_fsdp."""
    from fivefold.config import Layout
    from fivefold.measure.ledger import flattened_aliases
    from fivefold.mesh import build_mesh

    def aliases(**axes: int) -> dict[str, str]:
        lay = Layout(**axes)
        return flattened_aliases(build_mesh(lay, lay.world, 8))

    assert aliases(fsdp=4)["expert_fsdp"] == "fsdp"
    assert aliases(fsdp=2, cp=2)["expert_fsdp"] == "fsdp_cp"
    assert aliases(cp=4)["expert_fsdp"] == "fsdp_cp"
    assert "expert_fsdp" not in aliases(fsdp=4, ep=2)  # a real expert shard group of its own
