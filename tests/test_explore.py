"""The explore page's data: self-contained, the planner's own numbers, meshes, pipelines and runs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.config import Layout, load_hardware, load_model
from fivefold.explore import build_page, runtime_kernel, trace_bars
from fivefold.explore.lab import ENTRY_FIELDS, FEWEST, MEMORY_PARTS, ROW_FIELDS, lab_key, lab_table, shown
from fivefold.explore.meshview import SHOWN_AXES, addressing, groups, mesh_view
from fivefold.explore.timeline import expand, pipeline_picture
from fivefold.measure.bubble import simulated_bubble
from fivefold.mesh import build_mesh, resolve_layout
from fivefold.plan import TrainShape, plan
from fivefold.plan.memory import most_chunk_layers
from fivefold.plan.search import search
from fivefold.plan.trainers import sdpa_attention


def _embedded(html: str) -> dict:
    match = re.search(r'<script id="data" type="application/json">(.*?)</script>', html, re.S)
    assert match, "the page must embed its data"
    return json.loads(match.group(1))


SHAPE = TrainShape(seq_len=4096, global_batch=256, micro_batch=1)


@pytest.fixture(scope="module")
def page() -> str:
    model, hw = load_model("llama3-70b"), load_hardware("h100-80gb")
    layout = resolve_layout(Layout(tp=8, pp=2, dp=-1), 64)
    return build_page(model, hw, 64, SHAPE, layout, top=2, lab=False)


def test_page_is_self_contained(page: str) -> None:
    # nothing fetched from elsewhere: no external scripts, styles, fonts or images
    assert not re.search(r'(src|href)\s*=\s*"https?:', page)
    assert "<link" not in page and "@import" not in page and "url(http" not in page
    assert "/*FIVEFOLD_DATA*/" not in page


def test_page_embeds_the_layouts_plan(page: str) -> None:
    data = _embedded(page)
    first = data["layouts"][0]
    assert first["label"] == "your layout"
    model, hw = load_model("llama3-70b"), load_hardware("h100-80gb")
    layout = resolve_layout(Layout(tp=8, pp=2, dp=-1), 64)
    # of fivefold's runtime there: the attention kernel torch's SDPA runs on the GPU
    shape = runtime_kernel(SHAPE, hw.name)
    assert shape.attention == sdpa_attention(True)
    assert first["plan"] == json.loads(json.dumps(plan(model, hw, layout, shape).to_json()))
    assert len(data["layouts"]) == 3  # the given layout + the search's best two
    assert all(entry["plan"]["fits"] for entry in data["layouts"][1:])
    assert data["explanation"] and data["explanation"][0].startswith("Best:")
    assert data["subtitle"].startswith("70.55B parameters · sequence 4096")


def test_page_writes_a_small_models_size_as_people_do() -> None:
    """A 54K-parameter model had read "0.00B parameters" in the page's subtitle."""
    layout = resolve_layout(Layout(dp=-1), 2)
    small = build_page(
        load_model("tiny"), load_hardware("cpu"), 2, TrainShape(64, 4), layout, top=1, lab=False
    )
    assert _embedded(small)["subtitle"].startswith("53.54K parameters · sequence 64")


LAYOUTS = [
    (Layout(tp=8, pp=2, dp=4), 64),
    (Layout(tp=2, cp=2, fsdp=4, dp=2, pp=2), 64),
    (Layout(fsdp=4, cp=2, ep=4, dp=2), 16),
    (Layout(fsdp=2, cp=4, ep=8, tp=2), 16),
    (Layout(fsdp=2, cp=2, ep=2, tp=2, order="cp,tp,fsdp,dp,pp"), 8),
    (Layout(dp=2, fsdp=3, tp=2, order="pp,dp,tp,cp,fsdp"), 12),
]


@pytest.mark.parametrize("layout,world", LAYOUTS)
def test_mesh_arithmetic_gives_the_meshs_groups(layout: Layout, world: int) -> None:
    """The page finds groups by arithmetic; they must be build_mesh's, for every rank."""
    lay = resolve_layout(layout, world)
    info = build_mesh(lay, world, 4)
    for axis, address in addressing(lay).items():
        assert groups(world, address) == info.dims[axis].groups, axis


def test_only_chosen_axes_are_shown_and_every_rank_is_addressed() -> None:
    """Derived dims (batch, dp_fsdp_cp, fsdp_cp, expert_fsdp) are not axes; nothing is cut at 512 ranks."""
    dense = mesh_view(resolve_layout(Layout(tp=8, pp=16, fsdp=4, cp=2, dp=-1), 16384), 8)
    assert [d["name"] for d in dense["dims"]] == ["tp", "cp", "fsdp", "dp", "pp"]
    assert dense["world"] == 16384 and "group_index" not in dense
    moe = mesh_view(resolve_layout(Layout(fsdp=8, ep=8), 8), 8)
    assert [d["name"] for d in moe["dims"]] == ["ep", "fsdp"]
    assert set(SHOWN_AXES) == {"dp", "fsdp", "tp", "pp", "cp", "ep"}
    # the last pp group at 16,384 GPUs: ranks 1023, 2047, ..., 16383
    pp = next(d for d in dense["dims"] if d["name"] == "pp")
    last = groups(16384, pp)[-1]
    assert last == list(range(1023, 16384, 1024))


@pytest.mark.parametrize(
    "schedule,p,m,v",
    [
        ("gpipe", 4, 24, 1),
        ("1f1b", 4, 24, 1),
        ("interleaved-1f1b", 4, 24, 2),
        ("zero-bubble", 4, 24, 1),
        ("zbv", 4, 24, 2),
        ("dualpipev", 4, 24, 2),
    ],
)
def test_pipeline_picture_is_the_schedules_replay(schedule: str, p: int, m: int, v: int) -> None:
    """Every schedule at m beyond 16, drawn from its action table, with the drawn idle share beside it."""
    pic = pipeline_picture(schedule, p, m, v)
    sim = simulated_bubble(schedule, p, m, v, "1:2")
    assert pic["idle"] == pytest.approx(sim.idle_fraction)
    ops = pic["ops"]
    assert len(ops) == p
    chunks = p * (2 if schedule in ("zbv", "dualpipev") else v)
    kinds = {op[2] for row in ops for op in row}
    assert sum(op[2] == "F" for row in ops for op in row) == chunks * m  # every micro-batch, every chunk
    if schedule in ("zero-bubble", "zbv", "dualpipev"):
        assert {"I", "W"} <= kinds  # the split backward is drawn as two kinds
    # the figure printed is the one of the drawing: busy time over ranks × makespan
    busy = sum(op[1] for row in ops for op in row)
    assert 1 - busy / (p * pic["makespan"]) == pytest.approx(pic["idle"], abs=1e-4)
    cells = "".join(expand(r) for r in pic["raster"])
    assert cells.count(".") / len(cells) == pytest.approx(pic["idle"], abs=0.02)


def test_a_step_of_many_micro_batches_is_drawn_with_a_bounded_number_and_says_so() -> None:
    """An interleaved p=4 step of 4,096 micro-batches (a seq-len 1 default batch, say) took 33 s to
    replay; it is drawn with 256 of them, m_step keeping the step's own count for the caption."""
    import time

    start = time.perf_counter()
    pic = pipeline_picture("interleaved-1f1b", 4, 4096, 2)
    assert time.perf_counter() - start < 10
    assert (pic["m"], pic["m_step"]) == (256, 4096)
    assert pic["idle"] == pytest.approx(simulated_bubble("interleaved-1f1b", 4, 256, 2, "1:2").idle_fraction)
    assert pipeline_picture("zbv", 4, 24, 2)["m"] == pipeline_picture("zbv", 4, 24, 2)["m_step"] == 24


def test_dualpipev_layout_draws_its_own_bubble() -> None:
    """A V-schedule layout carries its replay; no stand-in schematic, no 16 micro-batch cut."""
    model, hw = load_model("deepseek-v3"), load_hardware("h100-80gb")
    layout = resolve_layout(Layout(pp=8, fsdp=16, ep=16, pp_schedule="dualpipev", virtual_stages=2), 128)
    data = _embedded(build_page(model, hw, 128, TrainShape(4096, 512), layout, top=0, lab=False))
    pic = data["layouts"][0]["pipeline"]
    assert (pic["schedule"], pic["p"], pic["m"], pic["v"]) == ("dualpipev", 8, 32, 2)
    assert pic["idle"] == pytest.approx(simulated_bubble("dualpipev", 8, 32, 2, "1:2").idle_fraction)
    # too few micro-batches for torch's table: the page says why instead of drawing something else
    data = _embedded(build_page(model, hw, 128, TrainShape(4096, 128), layout, top=0, lab=False))
    assert "micro" in data["layouts"][0]["pipeline"]["error"]


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def test_lab_carries_the_planners_numbers_for_every_considered_layout() -> None:
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    shape = TrainShape(seq_len=2048, global_batch=64)
    lab = lab_table(model, hw, 16, shape, 8)
    assert lab["entry_fields"] == list(ENTRY_FIELDS) and lab["row_fields"] == list(ROW_FIELDS)
    keys = [(f, rest) for f, by in lab["entries"].items() for rest in by]
    assert len(keys) > 100
    fewest = [(f, rest) for f, rest in keys if f"|{FEWEST}|" in f"|{rest}"]
    assert fewest  # some layouts fit only with full recompute of some blocks
    for f, rest in keys[:: max(len(keys) // 25, 1)] + fewest[:4]:
        got = dict(zip(ENTRY_FIELDS, lab["entries"][f][rest]))
        lay, sh = _lab_layout(f, rest, got["recompute_layers"], 16), _lab_shape(shape, rest)
        want = plan(model, hw, lay, sh, 8).to_json()
        assert got["fits"] == want["fits"] and got["microbatches"] == want["microbatches"]
        for k in ("step_time_s", "mfu", "bubble_fraction", "tokens_per_s"):
            assert got[k] == _sig(want[k]), k
        assert got["memory"] == [int(shown(want["memory"][k])) for k in MEMORY_PARTS]
        rows = [dict(zip(ROW_FIELDS, lab["rows"][i])) for i in got["comm"]]
        assert [lab["words"][r["op"]] for r in rows] == [c["op"] for c in want["comm"]]
        assert [r["bytes"] for r in rows] == [_sig(c["bytes"]) for c in want["comm"]]


def _lab_layout(factors: str, rest: str, recompute_layers: int, gpus: int) -> Layout:
    dp, fsdp, tp, pp, cp, ep, sp = map(int, factors.split("."))
    zero, rc, sv, _ = rest.split("|")
    sched, v = sv.split(".")
    layout = Layout(
        dp=dp,
        fsdp=fsdp,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        zero=int(zero),
        sp=bool(sp),
        recompute="full" if rc == FEWEST else rc,
        recompute_layers=recompute_layers,
        pp_schedule=sched if pp > 1 else "1f1b",
        virtual_stages=int(v),
    )
    return resolve_layout(layout, gpus)


def _lab_shape(shape: TrainShape, rest: str) -> TrainShape:
    return dataclasses.replace(shape, micro_batch=int(rest.split("|")[-1]))


def test_lab_offers_full_recompute_of_the_fewest_blocks_where_selective_does_not_fit() -> None:
    model, hw = load_model("llama3-8b"), load_hardware("h100-80gb")
    shape = TrainShape(seq_len=2048, global_batch=64)
    lab = lab_table(model, hw, 16, shape, 8)
    fewest = [
        (f, rest, dict(zip(ENTRY_FIELDS, e)))
        for f, by in lab["entries"].items()
        for rest, e in by.items()
        if f"|{FEWEST}|" in f"|{rest}"
    ]
    assert fewest
    for f, rest, got in fewest:
        n = got["recompute_layers"]
        lay = _lab_layout(f, rest, n, 16)
        assert 1 <= n < most_chunk_layers(model, lay, shape.seq_len) and got["fits"]  # the balanced split's
        if n > 1:  # one block fewer does not fit
            assert not plan(model, hw, _lab_layout(f, rest, n - 1, 16), _lab_shape(shape, rest), 8).fits
        assert not lab["entries"][f][rest.replace(FEWEST, "selective")][0]
    # the search's own pick lands on the same key (and the same block count) in the lab
    pins = {"tp": 1, "pp": 1, "cp": 1, "fsdp": 1, "micro_batch": 2}
    picks = search(model, hw, 16, shape, 8, pins=pins).plans
    assert any(p.layout.recompute_layers for p in picks)
    for p in picks:
        f, rest = lab_key(p.layout, p.shape.micro_batch).split("|", 1)
        entry = dict(zip(ENTRY_FIELDS, lab["entries"][f][rest]))
        assert entry["recompute_layers"] == p.layout.recompute_layers


def test_trace_bars_keep_the_last_step_and_name_ops() -> None:
    events = [
        {"ph": "X", "name": "forward", "pid": 0, "ts": 100, "dur": 50, "args": {"step": 1, "microbatch": 0}},
        {"ph": "X", "name": "forward", "pid": 1, "ts": 1000, "dur": 50, "args": {"step": 2, "microbatch": 0}},
        {
            "ph": "X",
            "name": "backward",
            "pid": 0,
            "ts": 1500,
            "dur": 100,
            "args": {"step": 2, "microbatch": 0},
        },
        {"ph": "M", "name": "process_name", "pid": 0},
    ]
    bars = trace_bars({"traceEvents": events})
    assert [(b["s"], b["op"]) for b in bars] == [(1, "F"), (0, "B")]
    # a step without a pipeline records its forwards and backwards as one event: not a forward
    whole = {"ph": "X", "name": "forward_backward", "pid": 0, "ts": 0, "dur": 9, "args": {"step": 3}}
    assert [b["op"] for b in trace_bars([whole, {**whole, "name": "optimizer", "ts": 9}])] == [
        "F+B",
        "optimizer",
    ]
    assert bars[0]["start"] == 0.0 and bars[1]["start"] == pytest.approx(0.5)  # ms after the first event
    assert bars[1]["dur"] == pytest.approx(0.1)


def write_run(run: Path, axis: str = "fsdp") -> Path:
    """A small run directory as `train` writes it: metrics with held-out loss, ledger, trace."""
    run.mkdir(parents=True, exist_ok=True)
    lines = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(1, 21)]
    for rec in lines[4::5]:
        rec["held_out_loss"] = rec["loss"] + 0.2
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    summary = [{"axis": axis, "op": "all_gather", "count": 4, "bytes": 64, "wire_bytes": 32}]
    (run / "ledger.json").write_text(json.dumps({"summary": summary}))
    events = [
        {"ph": "X", "name": n, "pid": r, "ts": t, "dur": 40, "args": {"step": 3, "microbatch": i}}
        for r in range(2)
        for i, (n, t) in enumerate([("forward", 100 + 50 * r), ("backward", 300 + 50 * r)])
    ]
    (run / "trace.json").write_text(json.dumps({"traceEvents": events}))
    return run


def test_run_directory_is_shown_with_held_out_loss(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    model, hw = load_model("tiny"), load_hardware("cpu")
    layout = resolve_layout(Layout(fsdp=2, tp=2), 4)
    shape = TrainShape(seq_len=64, global_batch=8, micro_batch=4)
    data = _embedded(build_page(model, hw, 4, shape, layout, run_dir=run, top=0, lab=False))
    metrics = data["run"]["metrics"]
    assert [m["step"] for m in metrics if "held_out_loss" in m] == [5, 10, 15, 20]
    assert data["run"]["ledger"][0]["axis"] == "fsdp"
    assert len(data["layouts"][0]["trace"]) == 4


def test_run_strings_cannot_end_the_embedded_data(tmp_path: Path) -> None:
    hostile = "</script><img src=x onerror=alert(1)><!--"
    run = write_run(tmp_path / "run", axis=hostile)
    model, hw = load_model("tiny"), load_hardware("cpu")
    layout = resolve_layout(Layout(fsdp=2), 2)
    html = build_page(
        model, hw, 2, TrainShape(seq_len=64, global_batch=4), layout, run_dir=run, top=0, lab=False
    )
    blob = html.split('<script id="data" type="application/json">', 1)[1].split("</script>", 1)[0]
    assert "<" not in blob
    assert _embedded(html)["run"]["ledger"][0]["axis"] == hostile
    # the page script builds the DOM with textContent only
    script = html.rsplit("<script>", 1)[1]
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "document.write" not in script


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1] / "src"))
    return subprocess.run(
        [sys.executable, "-m", "fivefold", "explore", *args], capture_output=True, text=True, env=env
    )


def _one_clean_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_cli_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    _one_clean_line(_cli("--gpus", "8"), "--model")
    _one_clean_line(_cli("--run", str(tmp_path)), "config.toml")
    _one_clean_line(_cli("--model", "tiny", "--gpus", "8", "--tp", "3", "--out", str(tmp_path / "x.html")))
    _one_clean_line(_cli("--model", "tiny", "--gpus", "8", "--seq-len", "0"), "--seq-len")
    _one_clean_line(_cli("--model", "tiny", "--gpus", "2", "--lab-also", "h200"), "--lab-also")


def _run_dir(tmp_path: Path) -> Path:
    """A run directory `explore --run` accepts: config.toml from a real tiny layout."""
    from fivefold.config import RunConfig

    run = write_run(tmp_path / "run")
    cfg = RunConfig(model=load_model("tiny"), layout=Layout(fsdp=2))
    (run / "config.toml").write_text(cfg.to_toml())
    return run


def test_cli_malformed_run_files_name_the_file(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    out = str(tmp_path / "p.html")
    (run / "ledger.json").write_text('{"summary": [')
    _one_clean_line(_cli("--run", str(run), "--top", "0", "--no-lab", "--out", out), "ledger.json")
    (run / "ledger.json").write_text(json.dumps({"summary": [{"axis": 5, "op": "x"}]}))
    _one_clean_line(_cli("--run", str(run), "--top", "0", "--no-lab", "--out", out), "ledger.json")
    write_run(run)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\nnot json\n{"step": 3, "loss": 1}\n')
    _one_clean_line(_cli("--run", str(run), "--top", "0", "--no-lab", "--out", out), "metrics.jsonl")
    write_run(run)
    (run / "trace.json").write_text("[{")
    _one_clean_line(_cli("--run", str(run), "--top", "0", "--no-lab", "--out", out), "trace.json")


def test_cli_hand_edited_run_configs_are_one_line(tmp_path: Path) -> None:
    """The run view plans the run's own config: an axis of 0 or micro-batches its batch does not
    split into end in one line naming config.toml or the constraint, never a traceback."""
    from fivefold.config import RunConfig, TrainSpec

    run = write_run(tmp_path / "run")
    out = str(tmp_path / "p.html")
    cfg = RunConfig(
        model=load_model("tiny"),
        layout=Layout(pp=2, microbatches=2),
        train=TrainSpec(seq_len=64, micro_batch=2, global_batch=4),
    )
    (run / "config.toml").write_text(cfg.to_toml().replace("tp = 1", "tp = 0"))
    _one_clean_line(_cli("--run", str(run), "--top", "0", "--no-lab", "--out", out), "config.toml")
    for microbatches in ("0", "3"):  # 0: the default, which must not divide by zero; 3 does not split 4
        text = cfg.to_toml().replace("microbatches = 2", f"microbatches = {microbatches}")
        (run / "config.toml").write_text(text)
        done = _cli("--run", str(run), "--top", "0", "--no-lab", "--out", out)
        if microbatches == "3":
            _one_clean_line(done, "microbatches")
        else:
            assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_cli_unwritable_out_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    args = ("--model", "tiny", "--gpus", "2", "--top", "0", "--no-lab", "--fsdp", "2")
    _one_clean_line(_cli(*args, "--out", str(blocker / "page.html")), "--out")
    _one_clean_line(_cli(*args, "--out", str(tmp_path)), "--out")


def test_cli_writes_the_page(tmp_path: Path) -> None:
    out = tmp_path / "page.html"
    done = _cli(
        *("--model", "llama3-8b", "--gpus", "16", "--tp", "4", "--seq-len", "2048", "--global-batch", "64"),
        *("--top", "1", "--no-lab", "--out", str(out)),
    )
    assert done.returncode == 0, done.stderr
    data = _embedded(out.read_text())
    assert data["layouts"][0]["mesh"]["world"] == 16 and data["labs"] == []


def test_a_run_is_planned_in_its_own_dtype_so_plan_and_ledger_agree(tmp_path: Path) -> None:
    """An fp32 run (train's default) gathers 4-byte weights: the page's plan shows the ledger's bytes
    and calls, not a bf16 plan's half."""
    from fivefold.cli import main
    from fivefold.config import RunConfig, TrainSpec
    from fivefold.plan.step import plan_step

    run = write_run(tmp_path / "run")
    model, layout = load_model("small"), Layout(fsdp=2, zero=3).resolve(2)
    cfg = RunConfig(model=model, train=TrainSpec(seq_len=256, micro_batch=4, global_batch=16), layout=layout)
    assert cfg.train.dtype == "fp32"
    (run / "config.toml").write_text(cfg.to_toml())
    out = tmp_path / "page.html"
    assert main(["explore", "--run", str(run), "--top", "0", "--no-lab", "--out", str(out)]) == 0
    planned = {
        (c["axis"], c["op"]): (c["count"], c["bytes"])
        for c in _embedded(out.read_text())["layouts"][0]["plan"]["comm"]
    }
    exact = plan_step(model, layout, 4, 256, 2, "fp32", {"pp": 0, "fsdp_cp": 0, "dp": 0}).comm
    assert planned[("fsdp", "all_gather")] == exact[("fsdp", "all_gather")]
    assert planned[("fsdp", "reduce_scatter")] == exact[("fsdp", "reduce_scatter")]
    # the run view sets the ledger beside the run's own step, every collective of it (the gradient
    # norm's all-reduces too, which the layout's plan leaves out)
    stepped = {
        (r["axis"], r["op"]): (r["count"], r["bytes"]) for r in _embedded(out.read_text())["run"]["planned"]
    }
    assert stepped == exact and ("fsdp", "all_reduce") in stepped


def test_a_pipelined_runs_micro_batches_are_the_ones_train_ran(tmp_path: Path, capsys) -> None:
    """train splits a pipelined data rank's batch (--micro-batch 8) into --microbatches 4 of 2
    sequences: the page plans those 4, as `plan --validate RUN_DIR` does, and prints no note that
    train would split it otherwise."""
    from fivefold.cli import main
    from fivefold.config import RunConfig, TrainSpec

    run = write_run(tmp_path / "run")
    layout = Layout(pp=2, fsdp=2, microbatches=4).resolve(4)
    cfg = RunConfig(model=load_model("tiny"), layout=layout, train=TrainSpec(seq_len=64, micro_batch=8))
    (run / "config.toml").write_text(cfg.to_toml())
    out = tmp_path / "page.html"
    capsys.readouterr()
    assert main(["explore", "--run", str(run), "--top", "0", "--no-lab", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "untold" not in printed and "wrote" in printed
    shown = _embedded(out.read_text())["layouts"][0]["plan"]
    assert shown["microbatches"] == 4 and shown["micro_batch"] == 2


def test_a_diverged_runs_curve_has_gaps_where_report_draws_them() -> None:
    """A NaN or infinite loss (a run that diverged, and stopped) is shown as a gap, not refused; a
    string where a number belongs is still one line naming the file."""
    import tempfile

    from fivefold.errors import FivefoldError
    from fivefold.explore.run import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.jsonl"
        path.write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": NaN, "held_out_loss": Infinity}\n')
        assert read_metrics(path) == [{"step": 1, "loss": 5.5}, {"step": 2}]
        path.write_text('{"step": 1, "loss": "5.5"}\n')
        with pytest.raises(FivefoldError, match="line 1: 'loss' is not a number"):
            read_metrics(path)


def test_the_pages_commands_plan_what_the_page_shows(capsys) -> None:
    """Every strategy card's and search layout's flags carry their batch split: on a CPU device plan
    and train take micro-batch 8 unless told, and the cards' commands had failed there."""
    import contextlib
    import io
    import shlex

    from fivefold.cli import main
    from fivefold.explore.strategy import strategy_cards

    model, hw = load_model("tiny"), load_hardware("cpu")
    fp32 = TrainShape(seq_len=128, global_batch=8, act_bytes=4, param_bytes=4)  # the CPU's dtype, as plan's
    cards = [c for c in strategy_cards(model, hw, 128, 8, fp32) if "flags" in c]
    assert {c["name"] for c in cards} >= {"DP", "ZeRO-1", "FSDP / ZeRO-3", "HSDP", "CP"}
    for c in cards:
        argv = f"plan --model tiny --hardware cpu --gpus {c['gpus']} --gpus-per-node 8 --seq-len 128 "
        argv += f"--global-batch {c['global_batch']} {c['flags']} --json"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(shlex.split(argv)) == 0, (c["name"], capsys.readouterr().err)
        assert json.loads(out.getvalue())["memory"] == c["memory"]
    page = _embedded(build_page(model, hw, 4, TrainShape(seq_len=32, global_batch=16, micro_batch=2), top=2))
    for entry in page["layouts"]:
        assert f"--micro-batch {entry['plan']['micro_batch']}" in entry["flags"]
