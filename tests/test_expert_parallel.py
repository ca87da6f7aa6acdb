"""Expert parallelism against the single-process model, and its all-to-alls in the comm ledger.

One spawn of 4 gloo ranks runs every layout in turn; each trains 3 AdamW steps (2 micro-batches
per data rank, clipping active) from the same seeded weights and global batches as the single
process, and must give the same losses (1e-5 relative) and the same updated parameters (1e-5
absolute, as the layout matrix). The ledger of one step's forward and backward must equal the
sharding rules' count (tests/parallel_theory.py) on every rank: the token all-to-alls on `ep` with
exactly the bytes the routing implies (per MoE layer and micro-batch, the rows sent out and the
rows received back in forward, the same again in backward, hidden × 4 bytes each, plus the [E]
int64 count exchange of each forward), the experts' FSDP over expert_fsdp, and the rest's FSDP.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest

from distributed import run_distributed
from fivefold.config import Layout, ModelSpec, TrainSpec, load_model

WORLD = 4
STEPS = 3
ACCUMULATION = 2
TRAIN = TrainSpec(seq_len=16, micro_batch=2, lr=1e-3, eps=1e-6, grad_clip=0.3, seed=5)
PARAM_ATOL = 1e-5
LEDGER_STEP = 1

CASES = [
    ("tiny-moe", dict(fsdp=2, dp=2, ep=2)),
    ("tiny-moe", dict(fsdp=4, ep=2)),  # expert_fsdp 2
    ("aux", dict(fsdp=4, ep=4)),
    ("tiny-moe", dict(fsdp=4, ep=4, zero=3)),
]


def model_spec(name: str) -> ModelSpec:
    if name == "aux":  # the sequence-wise auxiliary loss on: its gradient reaches the router
        return dataclasses.replace(load_model("tiny-moe"), name="aux", aux_loss_coef=0.01)
    return load_model(name)


def layout_and_rows(lay: dict) -> tuple[Layout, TrainSpec, int]:
    layout = Layout(**lay).resolve(WORLD)
    rows = TRAIN.micro_batch * layout.dp * layout.fsdp * ACCUMULATION
    return layout, dataclasses.replace(TRAIN, global_batch=rows), rows


def _run_cases(rank: int, world: int, cases: list) -> list[dict]:
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    import torch

    from fivefold.measure.ledger import CommLedger
    from fivefold.model.moe import moe_layers
    from fivefold.parallel.compare import run_layout
    from fivefold.parallel.device_mesh import build_runtime_mesh

    results = []
    for model, lay in cases:
        layout, train, rows = layout_and_rows(lay)
        mesh = build_runtime_mesh(layout)
        seen: dict = {"runners": []}
        _patch_capture(seen["runners"])

        def hook(step: int, phase: str, mesh=mesh, seen: dict = seen) -> None:
            if step != LEDGER_STEP:
                return
            experts = [m.experts for m in moe_layers(seen["runners"][0].model)]
            if phase == "begin":  # built after the runner, as the training loop does
                seen["ledger"] = CommLedger(mesh).__enter__()
                for e in experts:
                    e.rows_received = 0
            elif phase == "backward":
                seen["ledger"].next_step()
                seen["received"] = sum(e.rows_received for e in experts)
            else:
                seen["ledger"].__exit__(None, None, None)

        result, runner, optimizer = run_layout(model_spec(model), train, layout, rows, STEPS, mesh, hook)
        results.append(
            {
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "params": result.params if rank == 0 else None,
                "ledger": seen["ledger"].per_step(),
                "received": seen["received"],
            }
        )
        del runner, optimizer, seen
        torch.distributed.barrier()
    return results


def _patch_capture(box: list) -> None:
    """Keep the runner run_layout builds, so the hook can read its experts' row counters."""
    import fivefold.parallel.runners as apply

    original = getattr(apply, "_unpatched_build_runner", apply.build_runner)
    apply._unpatched_build_runner = original

    def build_runner(*args, **kwargs):
        runner = original(*args, **kwargs)
        box.append(runner)
        return runner

    apply.build_runner = build_runner


def test_received_rows_are_regrouped_by_local_expert() -> None:
    """Rows arrive by source rank, then local expert; the experts want them by local expert, then
    source rank, and the combine puts them back."""
    import torch

    from fivefold.parallel.expert import _by_local_expert, _inverse

    recv = torch.tensor([[2, 1, 0], [0, 3, 1], [1, 0, 2]])  # [source rank, local expert]
    arrived = [(r, e) for r in range(3) for e in range(3) for _ in range(int(recv[r, e]))]
    order = _by_local_expert(recv, len(arrived))
    by_expert = sorted(range(len(arrived)), key=lambda i: (arrived[i][1], arrived[i][0]))  # stable
    assert order.tolist() == by_expert
    assert torch.equal(order[_inverse(order)], torch.arange(len(arrived)))


_cache: list = []


def results() -> list[list[dict]]:
    if not _cache:
        per_rank = run_distributed(_run_cases, WORLD, CASES, timeout=300)
        _cache.append([[per_rank[r][i] for r in range(WORLD)] for i in range(len(CASES))])
    return _cache[0]


def case_id(case: tuple) -> str:
    model, lay = case
    return model + ":" + ",".join(f"{k}{v}" for k, v in lay.items())


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_matches_single_process(index: int) -> None:
    from fivefold.parallel.compare import compare, run_reference

    model, lay = CASES[index]
    _, train, rows = layout_and_rows(lay)
    ranks = results()[index]
    ref = run_reference(model_spec(model), train, rows, STEPS)
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]
    got = ranks[0]
    cmp = compare(ref, type(ref)(got["losses"], got["grad_norms"], got["params"]), 1e-5, PARAM_ATOL)
    assert max(cmp.loss_rel) <= 1e-5, (got["losses"], ref.losses)
    assert got["grad_norms"][0] == pytest.approx(ref.grad_norms[0], rel=1e-6)
    assert cmp.max_abs <= PARAM_ATOL, f"{cmp.worst_param}: {cmp.max_abs:.3g}"
    print(f"{case_id(CASES[index])}: loss rel {max(cmp.loss_rel):.2g}, param abs {cmp.max_abs:.2g}")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_ledger_matches_theory(index: int) -> None:
    """Every collective of one step's forward and backward on every rank, against the sharding
    rules (tests/parallel_theory.py): the token all-to-alls on `ep` with the bytes the routing
    implies, the experts' FSDP on expert_fsdp and their dp all-reduces, the rest's FSDP."""
    from parallel_theory import expected_forward_backward

    model, lay = CASES[index]
    spec = model_spec(model)
    layout, _, _ = layout_and_rows(lay)
    moe = sum(spec.is_moe_layer(i) for i in range(spec.layers))
    sent = moe * ACCUMULATION * TRAIN.micro_batch * TRAIN.seq_len * spec.experts_per_token
    ranks = results()[index]
    assert sum(r["received"] for r in ranks) == sent * WORLD  # every routed row lands somewhere
    for rank, r in enumerate(ranks):
        got = {(row["axis"], row["op"]): (row["count"], row["bytes"]) for row in r["ledger"][0]}
        theory = expected_forward_backward(
            spec, layout, TRAIN.micro_batch, TRAIN.seq_len, ACCUMULATION, received=r["received"]
        )
        assert got == theory, (rank, {k: (got.get(k), theory.get(k)) for k in got.keys() | theory.keys()})
