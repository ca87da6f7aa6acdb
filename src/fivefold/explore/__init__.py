"""`explore`: one self-contained HTML page that shows a layout as pictures.

It embeds the contract JSON of `mesh` and `plan` for the asked layout and the search's best few
(switchable on the page), and, given a run directory, its loss curve, ledger and measured
timeline. Pure Python: reads the run's JSON files, never imports torch. The page has no external
scripts, fonts or requests, so it opens from disk anywhere.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.errors import FivefoldError
from fivefold.mesh import build_mesh, describe
from fivefold.plan import Plan, TrainShape, plan
from fivefold.plan.search import layout_flags, search

MAX_RANKS_SHOWN = 512  # the grid shows the first nodes of bigger worlds
MAX_TRACE_EVENTS = 4000


def mesh_view(layout: Layout, world: int, gpus_per_node: int) -> dict[str, Any]:
    """The mesh reduced to what the page draws: per dim, each shown rank's group index."""
    shown = min(world, MAX_RANKS_SHOWN)
    info = build_mesh(layout, world, gpus_per_node)
    dims, group_index = [], {}
    for dim in info.dims.values():
        index = [0] * world
        for g, members in enumerate(dim.groups):
            for r in members:
                index[r] = g
        group_index[dim.name] = index[:shown]
        dims.append(
            {
                "name": dim.name,
                "size": dim.size,
                "link": dim.link,
                "comm": dim.comm,
                "groups_count": len(dim.groups),
            }
        )
    return {
        "world": world,
        "gpus_per_node": gpus_per_node,
        "dims": dims,
        "group_index": group_index,
        "group_index_shown": shown,
        "coords": [r.coords for r in info.ranks[:shown]],
        "reading": describe(info),
    }


def layout_entry(label: str, result: Plan) -> dict[str, Any]:
    mesh = mesh_view(result.layout, result.gpus, result.gpus_per_node)
    return {
        "label": label,
        "flags": layout_flags(result.layout),
        "plan": result.to_json(),
        "mesh": mesh,
        "reading": mesh["reading"],
    }


def read_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Metrics, ledger summary and the last step's timeline of a run directory."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FivefoldError(f"run directory not found: {run}")
    metrics_path = run / "metrics.jsonl"
    if not metrics_path.exists():
        raise FivefoldError(f"{run} is not a run directory: metrics.jsonl is missing")
    metrics = []
    for line in metrics_path.read_text().splitlines():
        if line.strip():
            try:
                metrics.append(json.loads(line))
            except json.JSONDecodeError:
                raise FivefoldError(f"{metrics_path}: a line is not JSON: {line[:60]!r}") from None
    ledger: list[dict[str, Any]] = []
    if (run / "ledger.json").exists():
        data = json.loads((run / "ledger.json").read_text())
        ledger = data.get("summary", []) if isinstance(data, dict) else []
    bars: list[dict[str, Any]] = []
    if (run / "trace.json").exists():
        bars = trace_bars(json.loads((run / "trace.json").read_text()))
    return {"metrics": metrics, "ledger": ledger}, bars


def trace_bars(trace: Any) -> list[dict[str, Any]]:
    """Complete ('X') events of the last traced step as bars: rank, op letter, start and length (ms)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    events = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]
    steps = [e.get("args", {}).get("step") for e in events if e.get("args", {}).get("step") is not None]
    if steps:
        last = max(steps)
        events = [e for e in events if e.get("args", {}).get("step") == last]
    # prefer the fine-grained pipeline events when a run recorded them
    fine = [e for e in events if str(e.get("cat", "")).startswith("pipeline")]
    events = (fine or events)[:MAX_TRACE_EVENTS]
    if not events:
        return []
    t0 = min(float(e["ts"]) for e in events)
    ranks = sorted({int(e.get("pid", 0)) for e in events})
    row = {r: i for i, r in enumerate(ranks)}
    bars = []
    for e in events:
        name = str(e.get("name", "?"))
        lower = name.lower()
        op = (
            "F"
            if lower.startswith(("f", "forward"))
            else "B"
            if lower.startswith(("b", "backward"))
            else "W"
            if lower.startswith(("w", "weight"))
            else name
        )
        bar = {
            "s": row[int(e.get("pid", 0))],
            "op": op,
            "start": (float(e["ts"]) - t0) / 1e3,
            "dur": float(e["dur"]) / 1e3,
        }
        mb = e.get("args", {}).get("microbatch")
        if mb is not None:
            bar["i"] = mb
        bars.append(bar)
    return bars


def build_page(
    model: ModelSpec,
    hw: HardwareSpec,
    gpus: int,
    shape: TrainShape,
    layout: Layout | None = None,
    gpus_per_node: int | None = None,
    run_dir: str | Path | None = None,
    top: int = 5,
) -> str:
    """The HTML page as a string."""
    gpn = gpus_per_node or hw.gpus_per_node
    layouts = []
    if layout is not None:
        layouts.append(layout_entry("your layout", plan(model, hw, layout, shape, gpn)))
    if top > 0:
        found = search(model, hw, gpus, shape, gpn, top=top)
        for i, p in enumerate(found.plans):
            layouts.append(
                layout_entry(
                    f"search #{i + 1}: {layout_flags(p.layout)} (micro-batch {p.shape.micro_batch})", p
                )
            )
    if not layouts:
        raise FivefoldError("nothing to show: give a layout or let the search run (--top > 0)")
    run, bars = read_run(run_dir) if run_dir else (None, [])
    if bars:
        layouts[0]["trace"] = bars
    data = {
        "title": f"{model.name} on {gpus} × {hw.name}",
        "subtitle": f"{model.num_params() / 1e9:.2f}B parameters · sequence {shape.seq_len} · global batch "
        f"{shape.global_batch} sequences · {gpn} GPUs per node",
        "layouts": layouts,
        "run": run,
    }
    template = (resources.files("fivefold.explore") / "page.html").read_text()
    # '</' inside embedded JSON would end the script element early
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return template.replace("/*FIVEFOLD_DATA*/", blob)
