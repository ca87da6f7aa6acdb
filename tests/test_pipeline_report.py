"""`fivefold report` on a synthetic run directory: the summary, the SVG bubble diagram, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.measure.timeline import CATEGORY, idle_fraction, merge_into_trace


def _event(kind: str, rank: int, start: float, dur: float, stage: int | None = None, mb: int | None = None):
    name = kind if mb is None else f"{stage}{kind}{mb}"
    return {
        "name": name,
        "cat": CATEGORY,
        "ph": "X",
        "ts": start,
        "dur": dur,
        "pid": rank,
        "tid": 0,
        "args": {"kind": kind, "step": 3, "pp_rank": rank, "stage": stage, "mb": mb},
    }


def _gpipe_trace() -> list[dict]:
    """Two ranks, two micro-batches, GPipe with unit forward and backward: idle = 1/3 by hand."""
    events = []
    for rank, ops in {
        0: [(0, "F", 0), (1, "F", 1), (4, "B", 0), (5, "B", 1)],
        1: [(1, "F", 0), (2, "F", 1), (3, "B", 0), (4, "B", 1)],
    }.items():
        for start, kind, mb in ops:
            events.append(_event(kind, rank, start * 1000.0, 1000.0, rank, mb))
        events.append(_event("recv", rank, 0.0 if rank else 2000.0, 500.0))
        events.append(_event("step", rank, 0.0, 6000.0))
    return events


def test_idle_fraction_by_hand():
    assert idle_fraction(_gpipe_trace()) == pytest.approx(1 - 8 / 12)


def test_report_draws_the_timeline_and_loss(tmp_path, capsys):
    metrics = [json.dumps({"step": s, "loss": 5.0 - 0.1 * s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(metrics))
    loop_event = {"name": "x", "ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 2, "cat": "compute"}
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": [loop_event]}))
    merge_into_trace(tmp_path / "trace.json", _gpipe_trace())
    assert main(["report", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "measured idle fraction 0.333" in text
    svg = (tmp_path / "report.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<title>") == 8 + 2  # 8 compute boxes, 2 waits
    assert "0F0" in svg and "1B1" in svg and "polyline" in svg
    kept = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "compute" for e in kept)  # the loop's own events survive the merge


def test_report_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["report", str(tmp_path)]) == 2  # a directory no run wrote: nothing drawn
    assert "not a run directory" in capsys.readouterr().err and not list(tmp_path.iterdir())
    merge_into_trace(tmp_path / "trace.json", _gpipe_trace())
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "x.gif")]) == 2
    assert main(["report", str(tmp_path), "--step", "9"]) == 2
    assert "recorded pipeline steps: [3]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "losses",
    [
        [(1e30, 5.0), (1e30, 4.0)],  # every record at one step beyond float resolution of step + 1
        [(1, 5.0), (2, float("nan")), (3, float("inf")), (4, 4.5)],  # a diverged step among finite ones
        [(1, float("nan"))],  # nothing finite to draw
        [(7, 1e30), (8, 1e30)],  # a flat loss where lo + 1 == lo
    ],
)
def test_report_draws_a_loss_curve_it_cannot_scale(tmp_path, capsys, losses):
    """A loss curve of one step, one value, or non-finite values draws (with unit spans, the
    non-finite points left out) instead of dividing by zero or writing NaN coordinates."""
    rows = [json.dumps({"step": s, "loss": v}) for s, v in losses]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows))
    assert main(["report", str(tmp_path)]) == 0, capsys.readouterr().err
    svg = (tmp_path / "report.svg").read_text()
    assert svg.startswith("<svg") and "nan" not in svg.lower()


def test_report_names_calls_and_bytes_as_plan_and_verify_do() -> None:
    """report's communication lines read in calls and decimal bytes, as plan's table and verify's rows
    do (they were 'ops' in KiB beside plan's 'calls' in kB)."""
    from fivefold.commands.report import summary

    ledger = {"rank": 0, "by_axis": {"fsdp": {"count": 12.0, "bytes": 428288.0, "wire_bytes": 321216.0}}}
    text = summary(Path("/nonexistent"), [{"step": 1, "loss": 5.0}], ledger, [], None)
    line = next(x for x in text.splitlines() if "fsdp" in x)
    assert "12 calls" in line and "428.3 kB" in line and "ops" not in line and "KiB" not in line
