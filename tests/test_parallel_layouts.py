"""Every layout of the matrix against the single-process model, the comm ledger and the memory meter.

One spawned gloo group per world size (2, 4, 8) runs all its layouts in sequence, dense and MoE,
building and destroying a mesh for each. Each layout trains 5 steps with 2 micro-batches per
data-parallel rank and global-norm clipping at 0.3 (active: the norms are above it), from the same
seeded weights and the same global batches as the single-process reference computed here.

Checks per layout:
  * losses within 1e-5 relative at every step, the step-0 gradient norm within 1e-6; gathered
    parameters after 5 steps within 1e-5 absolute, i.e. 0.2% of the 5e-3 that AdamW moves a
    weight in 5 steps at lr 1e-3. (Adam divides by the gradient's own scale, so an element whose
    gradient is ~0 up to rounding gets an update decided by the rounding; eps = 1e-6 and a small
    lr keep that from hiding a real difference, which shows up at the 1e-3 level or above);
  * the ledger of step 2's forward + backward equals `parallel_theory.expected_forward_backward`
    exactly, op by op and byte by byte; the optimizer phase sends only the 8-byte grad-norm
    reductions (plus ZeRO-1's parameter broadcasts, = every parameter once);
  * per-rank params / grads / optimizer bytes from `fivefold.measure.memory.state_bytes` equal the
    sharding arithmetic, and FSDP's parameter storage is padded / fsdp.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings

import pytest
import torch

from distributed import run_distributed
from fivefold.config import Layout, ModelSpec, TrainSpec, load_model
from parallel_theory import (
    expected_forward_backward,
    expected_param_storage,
    expected_state_bytes,
    zero_partition,
)

STEPS = 5
ACCUMULATION = 2
TRAIN = TrainSpec(seq_len=16, micro_batch=2, lr=1e-3, eps=1e-6, grad_clip=0.3, seed=3)
PARAM_ATOL = 1e-5
LEDGER_STEP = 2  # after DDP's bucket rebuild and FSDP's lazy init

# a model whose vocabulary (250) does not divide by 4: FSDP pads it
ODD = dict(name="odd", layers=2, hidden=24, heads=4, kv_heads=2, ffn_hidden=40, vocab=250, max_seq_len=64)

DENSE_MOE = ("tiny", "tiny-moe")
CASES: dict[int, list[tuple[str, dict]]] = {
    2: [
        (m, lay)
        for m in DENSE_MOE
        for lay in (dict(dp=2), dict(dp=2, zero=1), dict(fsdp=2, zero=2), dict(tp=2), dict(tp=2, sp=True))
    ],
    4: [
        (m, lay)
        for m in DENSE_MOE
        for lay in (
            dict(fsdp=4, zero=3),
            dict(dp=2, fsdp=2),
            dict(tp=4),
            dict(fsdp=2, tp=2, sp=True),
            dict(dp=2, tp=2),
        )
    ]
    + [("odd", dict(fsdp=4, zero=3)), ("tied", dict(fsdp=2, tp=2, sp=True))],
    8: [(m, dict(dp=2, fsdp=2, tp=2, sp=True)) for m in DENSE_MOE] + [("tiny", dict(dp=2, fsdp=2, tp=2))],
}


def model_spec(name: str) -> ModelSpec:
    if name == "tied":  # input and output embeddings share one weight (as the demo's `small` does)
        return dataclasses.replace(load_model("tiny"), name="tied", tie_embeddings=True)
    return ModelSpec(**ODD).validate() if name == "odd" else load_model(name)


def case_id(case: tuple[str, dict]) -> str:
    model, lay = case
    return model + ":" + ",".join(f"{k}{'' if v is True else v}" for k, v in lay.items())


def layout_and_rows(world: int, lay: dict) -> tuple[Layout, TrainSpec, int]:
    layout = Layout(**lay).resolve(world)
    rows = TRAIN.micro_batch * layout.dp * layout.fsdp * ACCUMULATION
    return layout, dataclasses.replace(TRAIN, global_batch=rows), rows


def _run_cases(rank: int, world: int, cases: list[tuple[str, dict]]) -> list[dict]:
    """On every rank: train each layout, with the ledger on one step and the memory meter after."""
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # 2-D gather notes
    from fivefold.measure.ledger import CommLedger
    from fivefold.measure.memory import local_tensor, state_bytes
    from fivefold.parallel.compare import ledger_step_hook, run_layout
    from fivefold.parallel.device_mesh import build_runtime_mesh

    results = []
    for model, lay in cases:
        start = time.perf_counter()
        spec = model_spec(model)
        layout, train, rows = layout_and_rows(world, lay)
        mesh = build_runtime_mesh(layout)
        ledger = CommLedger(mesh)

        hook = ledger_step_hook(ledger, LEDGER_STEP)
        result, runner, optimizer = run_layout(spec, train, layout, rows, STEPS, mesh, hook)
        part = runner.model_parts[0]
        storage = sum(local_tensor(p).untyped_storage().nbytes() for p in part.parameters())
        results.append(
            {
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "params": result.params if rank == 0 else None,
                "ledger": ledger.per_step(),
                "memory": state_bytes([part], optimizer),
                "storage": storage,
                "coords": {a: mesh.coord(a) for a in ("dp", "fsdp", "tp")},
                "seconds": time.perf_counter() - start,
            }
        )
        del runner, optimizer, part
        torch.distributed.barrier()
    return results


_cache: dict[int, list[list[dict]]] = {}
_references: dict[tuple[str, int], object] = {}


def results_for(world: int) -> list[list[dict]]:
    """Per case, per rank: what `_run_cases` returned (one spawn per world size, cached)."""
    if world not in _cache:
        per_rank = run_distributed(_run_cases, world, CASES[world], timeout=400)
        _cache[world] = [[per_rank[r][i] for r in range(world)] for i in range(len(CASES[world]))]
    return _cache[world]


def reference(model: str, rows: int):
    from fivefold.parallel.compare import run_reference

    key = (model, rows)
    if key not in _references:
        train = dataclasses.replace(TRAIN, global_batch=rows)
        _references[key] = run_reference(model_spec(model), train, rows, STEPS)
    return _references[key]


ALL = [(world, i, case) for world, cases in CASES.items() for i, case in enumerate(cases)]
IDS = [f"w{w}-{case_id(c)}" for w, _, c in ALL]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "index", "case"), ALL, ids=IDS)
def test_matches_single_process(world: int, index: int, case: tuple[str, dict]) -> None:
    from fivefold.parallel.compare import compare

    model, lay = case
    _, _, rows = layout_and_rows(world, lay)
    ranks = results_for(world)[index]
    ref = reference(model, rows)
    assert min(ref.grad_norms) > TRAIN.grad_clip, "clipping must be active for this test to cover it"
    for r in ranks:  # the loss is the global mean on every rank
        assert r["losses"] == ranks[0]["losses"]
    got = ranks[0]
    cmp = compare(ref, type(ref)(got["losses"], got["grad_norms"], got["params"]), 1e-5, PARAM_ATOL)
    assert max(cmp.loss_rel) <= 1e-5, (got["losses"], ref.losses)
    # same weights at step 0: the clip's global norm agrees to rounding; later steps carry the
    # (tolerated) parameter differences along
    assert got["grad_norms"][0] == pytest.approx(ref.grad_norms[0], rel=1e-6)
    assert got["grad_norms"] == pytest.approx(ref.grad_norms, rel=1e-4)
    assert cmp.max_abs <= PARAM_ATOL, f"{cmp.worst_param}: {cmp.max_abs:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize(("world", "index", "case"), ALL, ids=IDS)
def test_ledger_matches_theory(world: int, index: int, case: tuple[str, dict]) -> None:
    model, lay = case
    if model == "tied":
        pytest.skip("tied embeddings: checked against the single process only (one FSDP unit for both ends)")
    spec = model_spec(model)
    layout, train, _ = layout_and_rows(world, lay)
    expected = expected_forward_backward(spec, layout, train.micro_batch, train.seq_len, ACCUMULATION)
    for rank, r in enumerate(results_for(world)[index]):
        fwd_bwd, optimizer_phase = (r["ledger"] + [[]])[:2]  # a phase with no traffic has no rows
        got = {(row["axis"], row["op"]): (row["count"], row["bytes"]) for row in fwd_bwd}
        assert got == expected, f"rank {rank}"
        zero_broadcast = {(r["axis"], r["op"]): r for r in optimizer_phase if r["op"] == "broadcast"}
        if layout.zero == 1:
            total = sum(zero_partition(spec, layout.dp))
            assert zero_broadcast[("dp", "broadcast")]["bytes"] == total
        else:
            assert not zero_broadcast
        for row in optimizer_phase:  # the grad-norm: one fp64 scalar per reduction
            if row["op"] == "all_reduce":
                assert row["bytes"] == 8 * row["count"]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "index", "case"), ALL, ids=IDS)
def test_memory_matches_sharding(world: int, index: int, case: tuple[str, dict]) -> None:
    model, lay = case
    if model == "tied":
        pytest.skip("tied embeddings: checked against the single process only")
    spec = model_spec(model)
    layout, _, _ = layout_and_rows(world, lay)
    for rank, r in enumerate(results_for(world)[index]):
        assert r["memory"] == expected_state_bytes(spec, layout, r["coords"]), f"rank {rank}"
        if layout.fsdp > 1:
            assert r["storage"] == expected_param_storage(spec, layout), f"rank {rank}"
