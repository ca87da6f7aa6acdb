"""Context parallelism against the single-process model, and the cp traffic against its arithmetic.

One spawned 4-rank gloo group trains every case for a few AdamW steps from the same seeded
weights and global batches as the single-process reference computed here (2 micro-batches per
data-parallel rank, global-norm clipping active). Each case checks:
  * losses within 1e-5 relative at every step, the step-0 gradient norm within 1e-6, gathered
    parameters after the last step within 1e-5 absolute (the layout tests' tolerances);
  * the ledger's rows on axis `cp` for one step's forward + backward equal what the impl moves:
    allgather gathers K and V of every layer (backward reduce-scatters their gradients), ring
    passes them (and in backward their gradients) from rank to rank with send/recv,
    ulysses sends q, k, v and the output through all-to-all both ways; MoE layers add one small
    all-reduce of whole-sequence router statistics each way.
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
from parallel_theory import expected_forward_backward

STEPS = 3
ACCUMULATION = 2
TRAIN = TrainSpec(seq_len=16, micro_batch=2, lr=1e-3, eps=1e-6, grad_clip=0.3, seed=5)
PARAM_ATOL = 1e-5
LEDGER_STEP = 1
WORLD = 4
F32 = 4

CASES: list[tuple[str, dict]] = [
    ("tiny", dict(dp=2, cp=2, cp_impl="ring")),
    ("tiny", dict(dp=2, cp=2, cp_impl="allgather")),
    ("tiny", dict(dp=2, cp=2, cp_impl="ulysses")),
    ("tiny", dict(cp=2, fsdp=2, cp_impl="ring")),
    ("tiny", dict(cp=2, tp=2, cp_impl="allgather")),
    ("tiny-moe", dict(dp=2, cp=2, cp_impl="ring")),
    # a real ring (next ≠ previous rank), and Ulysses with fewer KV heads than cp ranks
    ("tiny", dict(cp=4, cp_impl="ring")),
    ("tiny", dict(cp=4, cp_impl="ulysses")),
]


def case_id(case: tuple[str, dict]) -> str:
    model, lay = case
    return model + ":" + ",".join(f"{k}{v}" for k, v in lay.items())


def layout_and_rows(lay: dict) -> tuple[Layout, TrainSpec, int]:
    layout = Layout(**lay).resolve(WORLD)
    rows = TRAIN.micro_batch * layout.dp * layout.fsdp * ACCUMULATION
    return layout, dataclasses.replace(TRAIN, global_batch=rows), rows


def expected_cp_traffic(spec: ModelSpec, layout: Layout) -> dict[tuple[str, str], tuple[int, int]]:
    """(axis, op) -> (count, bytes) on axis cp for one step's forward + backward passes."""
    cp, mb, d = layout.cp, TRAIN.micro_batch, spec.head_dim
    seq, local_seq = TRAIN.seq_len, TRAIN.seq_len // cp
    heads = spec.heads // layout.tp
    kv_heads = spec.kv_heads // layout.tp if layout.tp <= spec.kv_heads else spec.kv_heads
    passes = ACCUMULATION * spec.layers
    out: dict[tuple[str, str], tuple[int, int]] = {}
    if layout.cp_impl == "ulysses":
        kv = kv_heads if kv_heads % cp == 0 else heads
        q_bytes, kv_bytes = mb * heads * local_seq * d * F32, mb * kv * local_seq * d * F32
        # forward: q, k, v there and the output back; backward: the same four the other way
        out[("cp", "all_to_all")] = (8 * passes, passes * 2 * (2 * q_bytes + 2 * kv_bytes))
    elif layout.cp_impl == "ring":
        # forward: K and V (one buffer) hop cp-1 times; backward: they hop cp-1 times again and
        # the buffer of their gradients cp times (the last hop brings it to the block's owner)
        block = 2 * mb * kv_heads * local_seq * d * F32
        hops = passes * (3 * cp - 2)
        out[("cp", "send")] = out[("cp", "recv")] = (hops, hops * block)
    else:
        gathered = mb * kv_heads * seq * d * F32  # one of K, V for the whole sequence
        out[("cp", "all_gather")] = (2 * passes, 2 * passes * gathered)
        out[("cp", "reduce_scatter")] = (2 * passes, 2 * passes * gathered)
    if layout.dp * layout.fsdp == 1:
        # the cp group is then also the replica group: DDP (or `replicate` under tp) all-reduces
        # the gradients (and the loss) over it, as it would over dp = cp
        as_dp = Layout(dp=cp, tp=layout.tp).resolve(cp * layout.tp)
        theory = expected_forward_backward(spec, as_dp, mb, seq, ACCUMULATION)
        out[("cp", "all_reduce")] = theory[("dp", "all_reduce")]
    moe = sum(spec.is_moe_layer(i) for i in range(spec.layers))
    if moe and spec.aux_loss_coef > 0:  # counts and probability sums per sequence and expert
        stats = mb * 2 * spec.experts * F32
        out[("cp", "all_reduce")] = (2 * ACCUMULATION * moe, 2 * ACCUMULATION * moe * stats)
    return out


def _run_cases(rank: int, world: int, cases: list[tuple[str, dict]]) -> list[dict]:
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    from fivefold.measure.ledger import CommLedger
    from fivefold.parallel.compare import ledger_step_hook, run_layout
    from fivefold.parallel.device_mesh import build_runtime_mesh

    results = []
    for model, lay in cases:
        start = time.perf_counter()
        layout, train, rows = layout_and_rows(lay)
        mesh = build_runtime_mesh(layout)
        ledger = CommLedger(mesh)

        hook = ledger_step_hook(ledger, LEDGER_STEP)
        result, runner, optimizer = run_layout(load_model(model), train, layout, rows, STEPS, mesh, hook)
        results.append(
            {
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "params": result.params if rank == 0 else None,
                "ledger": ledger.per_step(),
                "seconds": time.perf_counter() - start,
            }
        )
        del runner, optimizer
        torch.distributed.barrier()
    return results


_cache: list[list[dict]] = []


def results() -> list[list[dict]]:
    """Per case, per rank (one spawn for all cases, cached)."""
    if not _cache:
        per_rank = run_distributed(_run_cases, WORLD, CASES, timeout=300)
        _cache.extend([[per_rank[r][i] for r in range(WORLD)] for i in range(len(CASES))])
    return _cache


def test_load_balanced_split_reassembles_the_sequence() -> None:
    from fivefold.parallel.context import gathered_positions, split_sequence

    tokens = torch.arange(3 * 24).view(3, 24) * 7
    for cp in (1, 2, 3, 4):
        shards = [split_sequence(tokens, cp, r) for r in range(cp)]
        chunk = 24 // (2 * cp)
        for r, (part, pos) in enumerate(shards):
            # chunks r and 2cp-1-r: an early and a late one, so causal work is balanced
            want = list(range(r * chunk, (r + 1) * chunk)) + list(
                range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)
            )
            assert pos[0].tolist() == want and (pos == pos[0]).all()
            assert torch.equal(part, tokens[:, want])
        # every position exactly once; scattering the shards back by position gives the sequence
        positions = torch.cat([pos[0] for _, pos in shards])
        assert sorted(positions.tolist()) == list(range(24))
        assert torch.equal(positions, gathered_positions(24, cp))
        whole = torch.empty_like(tokens)
        whole[:, positions] = torch.cat([part for part, _ in shards], dim=1)
        assert torch.equal(whole, tokens)


_references: dict[tuple[str, int], object] = {}


def reference(model: str, rows: int):
    from fivefold.parallel.compare import run_reference

    if (model, rows) not in _references:
        train = dataclasses.replace(TRAIN, global_batch=rows)
        _references[(model, rows)] = run_reference(load_model(model), train, rows, STEPS)
    return _references[(model, rows)]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_matches_single_process(index: int) -> None:
    from fivefold.parallel.compare import compare

    model, lay = CASES[index]
    _, _, rows = layout_and_rows(lay)
    ranks = results()[index]
    ref = reference(model, rows)
    assert min(ref.grad_norms) > TRAIN.grad_clip, "clipping must be active for this test to cover it"
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]
    got = ranks[0]
    cmp = compare(ref, type(ref)(got["losses"], got["grad_norms"], got["params"]), 1e-5, PARAM_ATOL)
    print(
        f"{case_id(CASES[index])}: loss rel {max(cmp.loss_rel):.2g}, params abs {cmp.max_abs:.2g}, "
        f"{got['seconds']:.1f} s"
    )
    assert max(cmp.loss_rel) <= 1e-5, (got["losses"], ref.losses)
    assert got["grad_norms"][0] == pytest.approx(ref.grad_norms[0], rel=1e-6)
    assert got["grad_norms"] == pytest.approx(ref.grad_norms, rel=1e-4)
    assert cmp.max_abs <= PARAM_ATOL, f"{cmp.worst_param}: {cmp.max_abs:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_ledger_shows_the_cp_traffic(index: int) -> None:
    model, lay = CASES[index]
    spec = load_model(model)
    layout, _, _ = layout_and_rows(lay)
    expected = expected_cp_traffic(spec, layout)
    for rank, r in enumerate(results()[index]):
        fwd_bwd = r["ledger"][0]
        # (DDP's broadcast of the model's buffers before each forward is not cp traffic)
        got = {
            (row["axis"], row["op"]): (row["count"], row["bytes"])
            for row in fwd_bwd
            if row["axis"] == "cp" and row["op"] != "broadcast"
        }
        assert got == expected, f"rank {rank}"
