"""The shared, torch-free arithmetic: one vocabulary, one stage split, used by planner and runtime."""

from __future__ import annotations

import subprocess
import sys
import time

from fivefold.config import Layout, load_model
from fivefold.layout_math import OPS, param_shapes, replica_axis, stage_split, wire_bytes


def test_the_ledger_records_only_the_shared_op_names() -> None:
    from fivefold.measure.ledger import C10D_OPS, FUNCTIONAL_OPS

    assert set(C10D_OPS.values()) | set(FUNCTIONAL_OPS.values()) <= set(OPS)


def test_planner_and_runtime_share_the_split() -> None:
    import fivefold.layout_math as shared
    from fivefold.parallel import pipeline

    for name in ("balanced_split", "parse_split", "stage_to_rank", "rank_stages", "stage_split"):
        assert getattr(pipeline, name) is getattr(shared, name)
    spec = load_model("tiny")
    assert stage_split(spec, Layout(pp=2, pp_split="1,3"), 16) == [1, 3]
    balanced = stage_split(spec, Layout(pp=2), 16)
    assert sum(balanced) == 4 and balanced == pipeline.check_pipeline(spec, Layout(pp=2, microbatches=2))


def test_the_performance_planner_follows_the_split() -> None:
    from fivefold.plan.memory import stage_counts

    spec = load_model("llama3-8b")
    lay = Layout(pp=4, pp_split="2,10,10,10")
    assert stage_counts(spec, 4, "first", lay) == (2, 0)
    assert stage_counts(spec, 4, "last", lay) == (10, 0)
    assert stage_counts(spec, 4, "first") == (8, 0)  # without the layout: ceil(L / pp)


def test_names_and_formulas() -> None:
    assert wire_bytes("all_reduce", 800, 4) == 1200 and wire_bytes("send", 800, 4) == 800
    assert replica_axis(Layout(dp=2, cp=2).resolve(4), ("dp", "fsdp", "cp")) == "dp_fsdp_cp"
    assert replica_axis(Layout(fsdp=2, cp=2).resolve(4), ("dp", "fsdp", "cp")) == "fsdp_cp"
    assert replica_axis(Layout(cp=2).resolve(2), ("dp", "fsdp", "cp")) == "cp"
    assert replica_axis(Layout(tp=2).resolve(2), ("dp", "fsdp")) is None
    assert "lm_head.weight" not in param_shapes(load_model("small"))  # tied: one weight


def test_the_step_planner_is_torch_free_and_fast() -> None:
    code = "import sys; import fivefold.plan.step, fivefold.plan.activations; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    from fivefold.plan.step import plan_step

    spec = load_model("tiny-moe")
    lay = Layout(pp=2, tp=2, fsdp=2, sp=True, zero=2, pp_schedule="interleaved-1f1b", virtual_stages=2)
    coords = dict(dp=0, fsdp=1, cp=0, tp=1, pp=1, ep=0, fsdp_cp=1, batch=1)
    plan_step(spec, lay.resolve(8), 2, 16, 4, "bf16", coords)
    start = time.perf_counter()
    for _ in range(50):
        plan_step(spec, lay.resolve(8), 2, 16, 4, "bf16", coords)
    assert (time.perf_counter() - start) / 50 < 0.005  # well under a millisecond on an idle core
