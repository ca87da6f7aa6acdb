"""A run directory read for the page: loss and held-out loss, the measured ledger, the timeline.

Everything here is untrusted input: each file is checked for the shape the page needs and a bad
one ends in one line naming it. The page puts these strings in the document as text only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fivefold.errors import FivefoldError, reason
from fivefold.runlog import finite_number, json_lines

MAX_TRACE_EVENTS = 4000
CURVES = ("loss", "held_out_loss")


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise FivefoldError(f"{path}: cannot be read ({exc.__class__.__name__})") from None
    except json.JSONDecodeError as exc:
        raise FivefoldError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # a 5000-digit number, nesting 10^5 deep
        raise FivefoldError(f"{path}: not valid JSON ({reason(exc)})") from None


def _diverged(value: Any) -> bool:
    """NaN or infinite: what a diverged step records (JSON's NaN and Infinity read as floats)."""
    return isinstance(value, float) and not math.isfinite(value)


def read_metrics(path: Path) -> list[dict[str, float]]:
    """Per step: the step and whichever of loss / held-out loss it recorded (numbers only)."""
    out = []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise FivefoldError(f"{path}: cannot be read ({exc.__class__.__name__})") from None
    for n, rec in json_lines(text, str(path)):
        if not isinstance(rec, dict) or not finite_number(rec.get("step")):
            raise FivefoldError(f"{path}: line {n} is not an object with a numeric 'step'")
        row = {"step": rec["step"]}
        for key in CURVES:
            value = rec.get(key)
            if value is None or _diverged(value):  # a diverged step is a gap in the curve, as report draws it
                continue
            if not finite_number(value):
                raise FivefoldError(f"{path}: line {n}: {key!r} is not a number")
            row[key] = value
        out.append(row)
    return out


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """The ledger's per-step summary rows: axis, op (strings) and count, bytes, wire bytes (numbers)."""
    data = _load_json(path)
    rows = data.get("summary") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise FivefoldError(f"{path}: expected an object with a 'summary' list of rows")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise FivefoldError(f"{path}: summary row {i} is not an object")
        clean: dict[str, Any] = {}
        for key in ("axis", "op"):
            if not isinstance(row.get(key), str):
                raise FivefoldError(f"{path}: summary row {i} has no string {key!r}")
            clean[key] = row[key]
        for key in ("count", "bytes", "wire_bytes"):
            value = row.get(key, 0)
            if not finite_number(value):
                raise FivefoldError(f"{path}: summary row {i}: {key!r} is not a number")
            clean[key] = value
        out.append(clean)
    return out


def trace_bars(trace: Any, path: Path | str = "trace.json") -> list[dict[str, Any]]:
    """Complete ('X') events of the last traced step as bars: rank, op letter, start and length (ms)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise FivefoldError(f"{path}: expected a list of trace events")
    events = [
        e
        for e in events
        if isinstance(e, dict)
        and e.get("ph") == "X"
        and finite_number(e.get("dur"))
        and finite_number(e.get("ts"))
    ]

    def args(e: dict) -> dict:
        return e["args"] if isinstance(e.get("args"), dict) else {}

    steps = [args(e)["step"] for e in events if finite_number(args(e).get("step"))]
    if steps:
        last = max(steps)
        events = [e for e in events if args(e).get("step") == last]
    # prefer the fine-grained pipeline events when a run recorded them
    fine = [e for e in events if str(e.get("cat", "")).startswith("pipeline")]
    events = (fine or events)[:MAX_TRACE_EVENTS]
    if not events:
        return []
    t0 = min(float(e["ts"]) for e in events)
    pids = sorted({int(e["pid"]) if finite_number(e.get("pid")) else 0 for e in events})
    row = {r: i for i, r in enumerate(pids)}
    bars = []
    for e in events:
        name = str(e.get("name", "?"))
        lower = name.lower()
        op = (
            "F+B"  # a step without a pipeline: its micro-batches' forwards and backwards, one event
            if lower.startswith("forward_backward")
            else "F"
            if lower.startswith(("f", "forward"))
            else "B"
            if lower.startswith(("b", "backward"))
            else "W"
            if lower.startswith(("w", "weight"))
            else name[:40]
        )
        bar: dict[str, Any] = {
            "s": row[int(e["pid"]) if finite_number(e.get("pid")) else 0],
            "rank": int(e["pid"]) if finite_number(e.get("pid")) else 0,
            "op": op,
            "start": (float(e["ts"]) - t0) / 1e3,
            "dur": float(e["dur"]) / 1e3,
        }
        mb = args(e).get("microbatch")
        if finite_number(mb):
            bar["i"] = int(mb)
        bars.append(bar)
    return bars


def planned_step(config: Path) -> list[dict[str, Any]]:
    """Rank 0's step as `fivefold.plan.step` plans it from the run's `config.toml`: the collectives
    `fivefold verify` checks a ledger against, beside the ledger's steady-step summary (balanced
    routing for MoE: the ledger counts the rows the router really sent)."""
    from fivefold.config import RunConfig
    from fivefold.plan.step import plan_step
    from fivefold.support import step_split

    cfg = RunConfig.from_toml(config)
    lay, train = cfg.layout.resolve(cfg.layout.world), cfg.train.validate()
    # a hand-edited config's batch may not split into its pipeline's micro-batches: one line, then
    micro_batch, microbatches = step_split(lay, train.micro_batch, train.grad_accum(lay.dp * lay.fsdp))
    origin = dict.fromkeys(("dp", "fsdp", "cp", "tp", "pp", "ep", "fsdp_cp", "batch"), 0)  # rank 0
    step = plan_step(cfg.model, lay, micro_batch, train.seq_len, microbatches, train.dtype, origin)
    return [{"axis": a, "op": o, "count": c, "bytes": b} for (a, o), (c, b) in sorted(step.comm.items())]


def read_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Metrics, ledger summary (with the step planned for it) and the last step's timeline of a run
    directory."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FivefoldError(f"run directory not found: {run}")
    metrics_path = run / "metrics.jsonl"
    if not metrics_path.exists():
        raise FivefoldError(f"{run} is not a run directory: metrics.jsonl is missing")
    metrics = read_metrics(metrics_path)
    ledger = read_ledger(run / "ledger.json") if (run / "ledger.json").exists() else []
    trace_path = run / "trace.json"
    bars = trace_bars(_load_json(trace_path), trace_path) if trace_path.exists() else []
    config = run / "config.toml"
    planned = planned_step(config) if ledger and config.exists() else []
    return {"metrics": metrics, "ledger": ledger, "planned": planned}, bars
