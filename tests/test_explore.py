"""The explore page: self-contained, embeds the right mesh and plan, reads run directories."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.config import Layout, load_hardware, load_model
from fivefold.explore import build_page, trace_bars
from fivefold.mesh import resolve_layout
from fivefold.plan import TrainShape, plan


def _embedded(html: str) -> dict:
    match = re.search(r'<script id="data" type="application/json">(.*?)</script>', html, re.S)
    assert match, "the page must embed its data"
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def page() -> str:
    model, hw = load_model("llama3-70b"), load_hardware("h100-80gb")
    layout = resolve_layout(Layout(tp=8, pp=2, dp=-1), 64)
    shape = TrainShape(seq_len=4096, global_batch=256, micro_batch=1)
    return build_page(model, hw, 64, shape, layout, top=2)


def test_page_is_self_contained(page: str) -> None:
    # nothing fetched from elsewhere: no external scripts, styles, fonts or images
    assert not re.search(r'(src|href)\s*=\s*"https?:', page)
    assert "<link" not in page and "@import" not in page
    assert "/*FIVEFOLD_DATA*/" not in page


def test_page_embeds_the_layouts_plan_and_groups(page: str) -> None:
    data = _embedded(page)
    first = data["layouts"][0]
    assert first["label"] == "your layout"
    model, hw = load_model("llama3-70b"), load_hardware("h100-80gb")
    layout = resolve_layout(Layout(tp=8, pp=2, dp=-1), 64)
    expected = plan(model, hw, layout, TrainShape(seq_len=4096, global_batch=256, micro_batch=1)).to_json()
    assert first["plan"]["step_time_s"] == pytest.approx(expected["step_time_s"])
    assert first["plan"]["memory"]["total"] == expected["memory"]["total"]
    # tp is innermost in the default order: ranks 8k..8k+7 form tp group k; pp is outermost
    tp_index = first["mesh"]["group_index"]["tp"]
    assert tp_index == [r // 8 for r in range(64)]
    pp_index = first["mesh"]["group_index"]["pp"]
    assert pp_index == [r % 32 for r in range(64)]
    assert len(data["layouts"]) == 3  # the given layout + the search's best two
    assert all(entry["plan"]["fits"] for entry in data["layouts"][1:])


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
    assert bars[0]["start"] == 0.0 and bars[1]["start"] == pytest.approx(
        0.5
    )  # ms after the step's first event
    assert bars[1]["dur"] == pytest.approx(0.1)


def test_run_directory_is_shown(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "loss": 5.0 - s}) for s in range(1, 4)) + "\n"
    )
    (run / "ledger.json").write_text(
        json.dumps(
            {"summary": [{"axis": "fsdp", "op": "all_gather", "count": 4, "bytes": 64, "wire_bytes": 32}]}
        )
    )
    model, hw = load_model("tiny"), load_hardware("cpu")
    layout = resolve_layout(Layout(fsdp=2, tp=2), 4)
    html = build_page(
        model, hw, 4, TrainShape(seq_len=64, global_batch=8, micro_batch=4), layout, run_dir=run, top=0
    )
    data = _embedded(html)
    assert [m["loss"] for m in data["run"]["metrics"]] == [4.0, 3.0, 2.0]
    assert data["run"]["ledger"][0]["axis"] == "fsdp"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fivefold", "explore", *args], capture_output=True, text=True
    )


def test_cli_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    missing = _cli("--gpus", "8")
    assert missing.returncode == 2 and "--model" in missing.stderr and "Traceback" not in missing.stderr
    not_a_run = _cli("--run", str(tmp_path))
    assert not_a_run.returncode == 2 and "config.toml" in not_a_run.stderr
    bad_layout = _cli("--model", "tiny", "--gpus", "8", "--tp", "3", "--out", str(tmp_path / "x.html"))
    assert bad_layout.returncode == 2 and "Traceback" not in bad_layout.stderr


def test_cli_writes_the_page(tmp_path: Path) -> None:
    out = tmp_path / "page.html"
    done = _cli(
        "--model",
        "llama3-8b",
        "--gpus",
        "16",
        "--tp",
        "4",
        "--seq-len",
        "2048",
        "--global-batch",
        "64",
        "--top",
        "1",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert out.exists() and _embedded(out.read_text())["layouts"][0]["mesh"]["world"] == 16


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless chromium is not installed")
def test_page_renders_in_a_browser(page: str, tmp_path: Path) -> None:
    path = tmp_path / "page.html"
    path.write_text(page)
    dom = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    grid = dom.split('id="grid"', 1)[1].split("</svg>", 1)[0]
    assert grid.count("<rect") == 64  # one cell per rank
    assert "does NOT fit" in dom or "(fits)" in dom
