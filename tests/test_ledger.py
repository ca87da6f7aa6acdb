"""The comm ledger on a 2×2×2 gloo mesh: each collective lands on its axis with the exact bytes."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from distributed import run_distributed
from fivefold.parallel.ledger import CommLedger, wire_bytes

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


def _ops(ledger: CommLedger) -> dict[tuple[str, str], tuple[int, int, float]]:
    rows = ledger.per_step()[-1] if ledger.per_step() else []
    return {(r["axis"], r["op"]): (r["count"], r["bytes"], r["wire_bytes"]) for r in rows}


def _body(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fivefold.config import Layout
    from fivefold.parallel.device_mesh import build_runtime_mesh

    warnings.simplefilter("ignore")
    out: dict = {}
    rm = build_runtime_mesh(Layout(tp=2, fsdp=2, pp=2, ep=2), gpus_per_node=4)
    out["groups"] = {a: dist.get_process_group_ranks(rm.group(a)) for a in ("tp", "fsdp", "pp", "ep")}

    def measure(label, fn):
        ledger = CommLedger(rm)
        with ledger:
            fn()
        out[label] = _ops(ledger)

    # a known collective on each axis
    measure("tp_all_reduce", lambda: dist.all_reduce(torch.ones(10), group=rm.group("tp")))
    measure("fsdp_all_gather", lambda: dist.all_gather_into_tensor(torch.empty(6), torch.ones(3),
                                                                   group=rm.group("fsdp")))
    measure("fsdp_reduce_scatter", lambda: dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8),
                                                                      group=rm.group("fsdp")))
    measure("ep_all_to_all", lambda: dist.all_to_all_single(torch.empty(6), torch.ones(6),
                                                            group=rm.group("ep")))
    pp_peer = dist.get_process_group_ranks(rm.group("pp"))[1 - rm.coord("pp")]

    def send_recv():
        if rm.coord("pp") == 0:
            dist.send(torch.ones(5), pp_peer)
        else:
            dist.recv(torch.empty(5), pp_peer)

    measure("pp_send_recv", send_recv)

    def batched():
        ops = [dist.P2POp(dist.isend, torch.ones(7), pp_peer),
               dist.P2POp(dist.irecv, torch.empty(7), pp_peer)]
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
    return out


@pytest.mark.slow
def test_ledger_on_a_gloo_mesh():
    results = run_distributed(_body, 8, timeout=180)
    for rank, res in enumerate(results):
        # layout tp 2, fsdp 2, pp 2 in the default order: tp stride 1, fsdp stride 2, pp stride 4
        assert res["groups"]["tp"] == sorted([rank, rank ^ 1])
        assert res["groups"]["fsdp"] == sorted([rank, rank ^ 2])
        assert res["groups"]["pp"] == sorted([rank, rank ^ 4])
        assert res["groups"]["ep"] == res["groups"]["fsdp"]  # ep folds onto fsdp (cp = 1)
        assert res["tp_all_reduce"] == {("tp", "all_reduce"): (1, 10 * F32, 2 * (2 - 1) / 2 * 10 * F32)}
        assert res["fsdp_all_gather"] == {("fsdp", "all_gather"): (1, 6 * F32, 6 * F32 / 2)}
        assert res["fsdp_reduce_scatter"] == {("fsdp", "reduce_scatter"): (1, 8 * F32, 8 * F32 / 2)}
        # same ranks as fsdp, but its own process group: credited to ep
        assert res["ep_all_to_all"] == {("ep", "all_to_all"): (1, 6 * F32, 6 * F32 / 2)}
        first_stage = rank < 4
        op = "send" if first_stage else "recv"
        assert res["pp_send_recv"] == {("pp", op): (1, 5 * F32, 5 * F32)}
        both = {("pp", "send"): (1, 7 * F32, 7 * F32), ("pp", "recv"): (1, 7 * F32, 7 * F32)}
        assert res["pp_batched"] == both
        params = (4 * 6 + 6) + (6 * 4 + 4)  # full parameter count of the two layers
        fsdp = res["fsdp2_step"]
        assert fsdp[("fsdp", "all_gather")] == (2, params * F32, params * F32 / 2)
        assert fsdp[("fsdp", "reduce_scatter")] == (2, params * F32, params * F32 / 2)
        assert set(fsdp) == {("fsdp", "all_gather"), ("fsdp", "reduce_scatter")}
        assert res["tp_dtensor"] == {("tp", "all_reduce"): (1, 3 * 4 * F32, 3 * 4 * F32)}
