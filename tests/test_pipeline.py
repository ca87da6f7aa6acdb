"""Pipeline parallelism: the split, the errors, and every schedule against the single-process model."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fivefold.config import Layout, TrainSpec, load_model
from fivefold.errors import FivefoldError
from fivefold.parallel.pipeline import (
    StageCosts,
    balanced_split,
    check_pipeline,
    parse_split,
    rank_stages,
    stage_costs,
    stage_to_rank,
)
from harness import Batch, Tolerance, assert_matches
from pipeline_cases import MICRO, SEQ, p2p, pipeline_case, train_briefly

SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("zero-bubble", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]


# ---- the split (no processes)


def _brute_force(costs: StageCosts, chunks: int) -> float:
    n = len(costs.layers)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), chunks - 1):
        bounds = (0, *cuts, n)
        best = min(
            best,
            max(costs.chunk_cost(bounds[k], bounds[k + 1], k == 0, k == chunks - 1) for k in range(chunks)),
        )
    return best


def test_balanced_split_is_optimal_against_brute_force():
    for layers, head, emb, chunks in [
        (8, 0.0, 0.0, 4),
        (8, 3.0, 0.0, 4),
        (9, 2.5, 1.0, 3),
        (12, 5.0, 0.5, 4),
        (7, 0.0, 4.0, 2),
    ]:
        costs = StageCosts(embedding=emb, layers=tuple(1.0 + 0.1 * (i % 3) for i in range(layers)), head=head)
        counts = balanced_split(costs, chunks)
        assert sum(counts) == layers and min(counts) >= 1 and len(counts) == chunks
        bounds = [sum(counts[:k]) for k in range(chunks + 1)]
        got = max(costs.chunk_cost(bounds[k], bounds[k + 1], k == 0, k == chunks - 1) for k in range(chunks))
        assert got == pytest.approx(_brute_force(costs, chunks))


def test_balanced_split_of_the_deepest_model_is_quick_and_still_optimal():
    """10,000 layers (the most a model may have) into 1 to 8 stages: the search keeps to chunks no
    longer than the even split allows (it took 24-38 s a split, and the plan's search minutes)."""
    import random
    import time

    start = time.perf_counter()
    for chunks in (1, 2, 4, 8):
        counts = balanced_split(StageCosts(3.0, (1.0,) * 10_000, 2.0), chunks)
        assert sum(counts) == 10_000 and max(counts) - min(counts) <= 4
    assert time.perf_counter() - start < 5
    rng = random.Random(3)  # uneven layers (MoE among dense), zero-cost ones too: still the optimum
    for _ in range(40):
        layers = tuple(rng.choice([0.0, 1.0, 1.0, 3.0]) for _ in range(rng.randint(2, 9)))
        chunks = rng.randint(1, len(layers))
        costs = StageCosts(rng.uniform(0, 3), layers, rng.uniform(0, 3))
        counts = balanced_split(costs, chunks)
        bounds = [sum(counts[:k]) for k in range(chunks + 1)]
        got = max(costs.chunk_cost(bounds[k], bounds[k + 1], k == 0, k == chunks - 1) for k in range(chunks))
        assert got == pytest.approx(_brute_force(costs, chunks))


def test_uniform_layers_split_evenly_and_a_heavy_head_gets_fewer_layers():
    assert balanced_split(StageCosts(0.0, (1.0,) * 8, 0.0), 4) == [2, 2, 2, 2]
    assert balanced_split(StageCosts(0.0, (1.0,) * 8, 2.0), 2) == [5, 3]
    # a real model: the head of a 128k-vocab Llama-8B is worth a few layers
    spec = load_model("llama3-8b")
    counts = balanced_split(stage_costs(spec, 4096), 4)
    assert sum(counts) == 32 and counts[-1] < counts[0]


def test_v_shaped_placement_folds_the_chunks():
    assert [stage_to_rank(s, 4, "zbv") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_to_rank(s, 4, "interleaved-1f1b") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert rank_stages(0, 4, 2, "dualpipev") == [0, 7]
    assert rank_stages(1, 4, 2, "zero-bubble") == [1, 5]


def test_manual_split():
    assert parse_split("3, 1", 4, 2) == [3, 1]
    assert parse_split("0,4", 4, 2) == [0, 4]  # the first chunk may hold only the embedding
    for bad, match in [
        ("2,1", "adds up"),
        ("1,2,1", "names 3 chunks"),
        ("a,b", "layer counts"),
        ("2,0,2", None),
    ]:
        chunks = 3 if bad == "2,0,2" else 2
        with pytest.raises(FivefoldError, match=match):
            parse_split(bad, 4, chunks)
    spec = load_model("tiny")
    assert check_pipeline(spec, Layout(pp=2, pp_split="3,1").resolve(2)) == [3, 1]


@pytest.mark.parametrize(
    "layout, train, match",
    [
        (Layout(pp=8), None, "exceeds the 4 layers"),
        (Layout(pp=4, pp_schedule="1f1b", microbatches=2), None, "at least 4 micro-batches"),
        (Layout(pp=2, pp_schedule="dualpipev", microbatches=2), None, "at least 4 micro-batches"),
        (Layout(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=3, microbatches=4), None, "virtual"),
        (Layout(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2, microbatches=5), None, "multiple of"),
        (Layout(pp=2, pp_schedule="gpipe", virtual_stages=2), None, "one chunk per rank"),
        (Layout(pp=2, microbatches=4), TrainSpec(micro_batch=6), "does not divide into --microbatches 4"),
        (Layout(pp=2, fsdp=2, pp_schedule="zbv", microbatches=4), None, "use --zero 2"),
    ],
)
def test_clear_errors(layout, train, match):
    spec = load_model("tiny")
    with pytest.raises(FivefoldError, match=match):
        check_pipeline(spec, layout.resolve(layout.pp * layout.fsdp), train)


def test_interleaved_chunks_may_differ_by_a_layer():
    """6 layers in 4 chunks: the cost-balanced split, as the planner prices it (Llama 3's 126 layers
    ran on 16 stages so); the case below trains it against the single process."""
    spec = dataclasses.replace(load_model("tiny"), layers=6)
    layout = Layout(pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2, microbatches=4).resolve(2)
    split = check_pipeline(spec, layout)
    assert sum(split) == 6 and len(split) == 4 and max(split) - min(split) == 1


# ---- every schedule on 2 gloo ranks, against the single-process model


TOLERANCE = Tolerance(
    loss_rel=1e-5,
    first_norm_rel=1e-4,
    norm_rel=1e-4,
    eval_rel=1e-5,
    # AdamW at lr 1e-2 moves every weight ~1e-2 a step: a wrong gradient shows at that size, while
    # float summation order (stages, clipping) leaves ~1e-5 on the few weights with tiny gradients
    param_abs=5e-5,
)
CASES = [
    pipeline_case(2, pp=2, pp_schedule=s, virtual_stages=v, microbatches=4, ledger=(s in ("1f1b", "zbv")))
    for s, v in SCHEDULES
] + [
    pipeline_case(2, model="tiny-moe", pp=2, pp_schedule="1f1b", microbatches=4),
    pipeline_case(2, model="tiny-moe", pp=2, pp_schedule="zero-bubble", virtual_stages=2, microbatches=4),
    pipeline_case(2, pp=2, pp_schedule="1f1b", microbatches=4, recompute="full"),
    pipeline_case(2, layers=6, pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2, microbatches=4),
    pipeline_case(2, pp=2, pp_schedule="gpipe", pp_split="3,1", microbatches=2),
]


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pp_run")


@pytest.fixture(scope="module")
def two_ranks(train_dir) -> list[list[dict]]:
    """Per case, per rank; the spawn also runs a short training run through the loop."""
    loop = dict(pp=2, pp_schedule="1f1b", microbatches=4)
    batch = Batch(CASES, then=lambda: (train_briefly, (str(train_dir), loop)))
    return [batch.ranks(case) for case in CASES]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)))
def test_two_stage_pipeline_matches_single_process(two_ranks, index):
    case, per_rank = CASES[index], two_ranks[index]
    assert_matches(case, per_rank, TOLERANCE)
    names = per_rank[0]["names"] + per_rank[1]["names"]
    assert len(names) == len(set(names))  # disjoint stages ...
    from fivefold.model import build_model

    # ... covering the model
    assert sorted(names) == sorted(n for n, _ in build_model(case.spec()).named_parameters())


@pytest.mark.slow
def test_manual_split_is_used(two_ranks):
    result = two_ranks[-1][0]
    assert result["split"] == [3, 1]
    assert sum(".layers." in n for n in result["names"]) == 3 * 9  # 9 tensors per tiny layer


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_ledger_counts_activations_and_gradients_per_micro_batch(two_ranks, schedule):
    index = [s for s, _ in SCHEDULES].index(schedule)
    spec = load_model("tiny")
    m, v = 4, 2 if schedule == "zbv" else 1
    activation = MICRO * SEQ * spec.hidden * 4  # fp32
    for rank in range(2):
        result = two_ranks[index][rank]
        # boundaries between chunks on different ranks, seen from this rank: each carries m
        # activations forward and m gradients back
        boundaries = [
            s
            for s in range(2 * v - 1)
            if stage_to_rank(s, 2, schedule) != stage_to_rank(s + 1, 2, schedule)
            and rank in (stage_to_rank(s, 2, schedule), stage_to_rank(s + 1, 2, schedule))
        ]
        ops = m * len(boundaries)  # per step and direction: one tensor per micro-batch per boundary
        for op in ("send", "recv"):
            count, nbytes = p2p(result)[op]
            assert count == pytest.approx(ops) and nbytes == pytest.approx(ops * activation)


@pytest.mark.slow
def test_timeline_records_every_op_of_the_schedule(two_ranks):
    for index, (schedule, _) in enumerate(SCHEDULES):
        for rank in range(2):
            result = two_ranks[index][rank]
            kinds = {(s, k, mb) for s, k, mb in result["kinds"]}
            for stage in result["stages"]:
                forwards = {mb for s, k, mb in kinds if s == stage and k == "F"}
                backwards = {mb for s, k, mb in kinds if s == stage and k in ("B", "I")}
                assert forwards == backwards == set(range(4)), (schedule, stage)
            if schedule == "zero-bubble":
                assert any(k == "W" for _, k, _ in kinds)
            assert result["comm_events"] > 0
        assert 0.0 < two_ranks[index][0]["measured_idle"] < 1.0  # gathered on rank 0


@pytest.mark.slow
def test_training_loop_end_to_end_and_report(two_ranks, train_dir, capsys):
    import json

    from fivefold.cli import main
    from fivefold.measure.timeline import load_pipeline_events

    metrics = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["loss"] > 0 for m in metrics)
    events = load_pipeline_events(train_dir / "trace.json")
    assert {e["pid"] for e in events} == {0, 1}  # both stages' timelines reached trace.json
    for rank in (0, 1):
        kinds = {e["args"]["kind"] for e in events if e["pid"] == rank}
        assert {"F", "B", "idle", "step"} <= kinds
    ledger = json.loads((train_dir / "ledger.json").read_text())
    assert [s["step"] for s in ledger["per_step"]] == [1, 2, 3]  # numbered as metrics.jsonl numbers them
    assert any(r["axis"] == "pp" and r["op"] == "send" for r in ledger["summary"])
    # the summary is the steady step (the first exchanges shapes), and it is the step the planner
    # plans for the run's config.toml, tied embeddings' gradient sum included: the explorer shows both
    from fivefold.explore.run import planned_step

    assert ledger["summary_skips"] == 2
    measured = {(r["axis"], r["op"]): (r["count"], r["bytes"]) for r in ledger["summary"]}
    planned = {
        (r["axis"], r["op"]): (r["count"], r["bytes"]) for r in planned_step(train_dir / "config.toml")
    }
    assert measured == planned and planned[("pp", "all_reduce")][0] == 2
    # the trace numbers its steps as metrics.jsonl and the checkpoints do (1..3), so --step 3 is the last
    assert {e["args"]["step"] for e in events if e["args"]["kind"] == "step"} == {1, 2, 3}
    assert main(["report", str(train_dir), "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert "measured idle fraction" in out and "pipeline step 3" in out
    svg = (train_dir / "report.svg").read_text()
    assert svg.count("rank 1 (pp 1)") == 2  # measured, and replayed from the action table
    assert "predicted from the schedule" in svg


@pytest.mark.slow
def test_1f1b_holds_fewer_micro_batches_than_gpipe(two_ranks):
    # GPipe keeps all m micro-batches' activations until the backward; 1F1B keeps min(p - r, m)
    # on pp rank r (Narayanan et al. 2019): here m = 4, p = 2 -> ratios 2 and 4
    m, p = 4, 2
    for rank in range(p):
        gpipe, one_f_one_b = two_ranks[0][rank]["activation_peak"], two_ranks[1][rank]["activation_peak"]
        assert gpipe / one_f_one_b == pytest.approx(m / min(p - rank, m), rel=0.2)


def test_report_replays_a_long_step_with_the_micro_batches_explore_draws(tmp_path) -> None:
    """A run of thousands of micro-batches is replayed with at most explore's count (torch's action
    table grows faster than linearly in m), and the report says how many it replayed."""
    import time

    from fivefold.commands.report import _predicted_idle, predicted_timeline
    from fivefold.config import Layout, RunConfig, load_model
    from fivefold.explore.timeline import MAX_DRAWN_MICROBATCHES

    layout = Layout(pp=4, pp_schedule="interleaved-1f1b", virtual_stages=2, microbatches=4096)
    config = tmp_path / "config.toml"
    config.write_text(RunConfig(model=load_model("small"), layout=layout.resolve(4)).to_toml())
    start = time.perf_counter()
    events = predicted_timeline(config)
    assert time.perf_counter() - start < 20  # the whole table took minutes
    forwards = {e["name"] for e in events if e["args"]["kind"] == "F" and e["pid"] == 0}
    assert len(forwards) == 2 * MAX_DRAWN_MICROBATCHES  # each micro-batch through both chunks
    assert _predicted_idle(events).endswith(f"with {MAX_DRAWN_MICROBATCHES} of its 4096 micro-batches")
