"""`fivefold report RUN_DIR`: a run's loss curve, its ledger per axis, and the measured pipeline
timeline drawn as the classic bubble diagram (one row per rank; F, B, I, W coloured; idle white).

SVG is written by hand (no dependency); PNG goes through matplotlib. Without `--out` the picture is
`RUN_DIR/report.svg`. The text summary goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
from html import escape
from pathlib import Path
from typing import Any

from fivefold.errors import FivefoldError, reason
from fivefold.outputs import write_text_whole, write_whole
from fivefold.runlog import finite_number, json_lines

COLORS = {
    "F": "#4e79a7",
    "B": "#59a14f",
    "I": "#8cd17d",
    "W": "#f28e2b",
    "send": "#bab0ac",
    "recv": "#bab0ac",
    "send/recv": "#bab0ac",
}
LEGEND = [
    ("F", "forward"),
    ("B", "backward"),
    ("I", "input-grad backward"),
    ("W", "weight-grad backward"),
    ("recv", "waiting on send/recv"),
    ("idle", "idle"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by fivefold train")
    parser.add_argument(
        "--out",
        default=None,
        metavar="FILE.svg|FILE.png",
        help="picture to write (default RUN_DIR/report.svg)",
    )
    parser.add_argument(
        "--step", type=int, default=None, help="which recorded pipeline step to draw (default: the last)"
    )


def _memory_line(run_dir: Path) -> str:
    """Rank 0's measured memory beside the plan of its stage, where the run measured it and its
    config.toml plans (`fivefold plan --validate` gives the same, with the step time)."""
    from fivefold.plan.validation import run_dir_memory

    if not (run_dir / "config.toml").is_file():
        return ""
    try:
        rows = run_dir_memory(run_dir)
    except FivefoldError:  # a run the planner cannot take (said by `plan --validate`): no line
        return ""
    names = {"activations": "saved activations"}
    lines = [
        f"    {names.get(part, part):<18}{got / 1e6:>10.3f} MB  (plan {want / 1e6:.3f})"  # decimal, as plan's
        for part, got, want in rows
    ]
    return "\n".join(["  memory of rank 0, measured (plan of its stage):", *lines]) if lines else ""


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        what = "is a file, not a run directory" if run_dir.exists() else "not found"
        raise FivefoldError(f"run directory {run_dir}: {what}; give the --run-dir of a train run")
    written = ("metrics.jsonl", "ledger.json", "trace.json", "config.toml")
    if not any((run_dir / name).is_file() for name in written):
        raise FivefoldError(
            f"{run_dir} is not a run directory: it holds none of {', '.join(written)}; give the "
            "--run-dir of a `fivefold train` or `fivefold verify` run"
        )
    out = Path(args.out) if args.out else run_dir / "report.svg"
    if out.suffix not in (".svg", ".png"):
        raise FivefoldError(f"--out must end in .svg or .png, got {out.name}")
    metrics = _read_metrics(run_dir / "metrics.jsonl")
    ledger = _check_ledger(_read_json(run_dir / "ledger.json"), run_dir / "ledger.json")
    from fivefold.measure.timeline import idle_fraction, load_pipeline_events

    try:
        events = load_pipeline_events(run_dir / "trace.json")
    except (ValueError, OSError) as exc:  # not JSON, not text, not a list of events
        raise FivefoldError(f"cannot read {run_dir / 'trace.json'}: {exc}") from None
    events = _check_events(events, run_dir / "trace.json")
    step = _pick_step(events, args.step)
    timeline = [e for e in events if e["args"].get("step") == step]
    print(summary(run_dir, metrics, ledger, timeline, idle_fraction(events, step) if timeline else None))
    memory = _memory_line(run_dir)
    if memory:
        print(memory)
    predicted = predicted_timeline(run_dir / "config.toml") if timeline else []
    if predicted:
        idle = _predicted_idle(predicted)
        print(f"  the schedule's action table at 1:2 costs predicts idle fraction {idle}")
    if out.suffix == ".svg":
        write_text_whole(out, render_svg(metrics, timeline, ledger, title=run_dir.name, predicted=predicted))
    else:
        render_png(metrics, timeline, out, title=run_dir.name)
    print(f"wrote {out}")
    return 0


# ---- reading


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, not text
        raise FivefoldError(f"cannot read {path}: {exc}") from None


def _real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _read_metrics(path: Path) -> list[dict]:
    """Every step's record; each must carry a numeric step and loss, which the summary and plot use."""
    if not path.exists():
        return []
    records = [rec for _, rec in json_lines(_read_text(path), f"malformed {path}")]
    for n, rec in enumerate(records, start=1):
        if not isinstance(rec, dict) or not _real(rec.get("step")) or not _real(rec.get("loss")):
            raise FivefoldError(f"malformed {path}: record {n} is not an object with a numeric step and loss")
        if rec.get("held_out_loss") is not None and not _real(rec["held_out_loss"]):
            raise FivefoldError(f"malformed {path}: record {n}: held_out_loss is not a number")
    return records


def _read_json(path: Path) -> Any:
    if not path.exists():
        return None
    try:
        return json.loads(_read_text(path))
    except (ValueError, RecursionError) as exc:  # not JSON, a 5000-digit number, deep nesting
        raise FivefoldError(f"malformed {path}: {reason(exc)}") from None


def _check_ledger(ledger: Any, path: Path) -> Any:
    """The ledger as the summary reads it: per axis a numeric count and bytes."""
    if ledger is None:
        return None
    by_axis = ledger.get("by_axis") if isinstance(ledger, dict) else None
    if not isinstance(ledger, dict) or not isinstance(by_axis, dict | None):
        raise FivefoldError(f"malformed {path}: expected an object with a 'by_axis' table")
    for axis, row in (by_axis or {}).items():
        if not (
            isinstance(row, dict) and finite_number(row.get("count")) and finite_number(row.get("bytes"))
        ):
            raise FivefoldError(f"malformed {path}: by_axis {axis!r} needs a numeric count and bytes")
    return ledger


def _check_events(events: list, path: Path) -> list[dict]:
    """Pipeline events as the timeline draws them: name, rank, start and length, and their kind."""
    for i, e in enumerate(events):
        args = e.get("args")
        if not (
            isinstance(e.get("name"), str)
            and all(finite_number(e.get(key)) for key in ("pid", "ts", "dur"))
            and e["dur"] >= 0
            and isinstance(args, dict)
            and isinstance(args.get("kind"), str)
            and finite_number(args.get("step"))
        ):
            raise FivefoldError(
                f"malformed {path}: pipeline event {i} needs a name, a finite pid, ts and dur (not "
                "negative), and args with a kind and a finite step"
            )
    # every rank's step is drawn and measured against that step's window on the rank
    windows = {(e["pid"], e["args"]["step"]) for e in events if e["args"]["kind"] == "step"}
    for e in events:
        if (e["pid"], e["args"]["step"]) not in windows:
            raise FivefoldError(
                f"malformed {path}: rank {e['pid']} has events of step {e['args']['step']} but no step "
                "window (an event of kind step) for them"
            )
    return events


def _pick_step(events: list[dict], wanted: int | None) -> int | None:
    steps = sorted({e["args"]["step"] for e in events if e["args"].get("kind") == "step"})
    if not steps:
        if wanted is not None:
            raise FivefoldError(f"--step {wanted}: this run recorded no pipeline steps (it ran without --pp)")
        return None
    if wanted is None:
        return steps[-1]
    if wanted not in steps:
        raise FivefoldError(f"--step {wanted} was not recorded; recorded pipeline steps: {steps}")
    return wanted


# ---- text


def summary(
    run_dir: Path, metrics: list[dict], ledger: Any, timeline: list[dict], bubble: float | None
) -> str:
    lines = [f"run {run_dir}"]
    if metrics:
        last = metrics[-1]
        lines.append(f"  steps {last.get('step')}, last loss {last.get('loss'):.4f}")
        held = [m for m in metrics if m.get("held_out_loss") is not None]
        if held:
            lines.append(f"  held-out loss {held[-1]['held_out_loss']:.4f} at step {held[-1]['step']}")
    if ledger and ledger.get("by_axis"):
        lines.append(f"  communication per step and rank (rank {ledger.get('rank', 0)}):")
        for axis, row in ledger["by_axis"].items():
            # calls and decimal bytes, as `plan` and `verify` name them
            lines.append(f"    {axis:<11} {row['count']:>8g} calls {_bytes(row['bytes']):>10}")
    if timeline:
        ranks = sorted({e["pid"] for e in timeline})
        lines.append(
            f"  pipeline step {timeline[0]['args']['step']}: measured idle fraction {bubble:.3f} "
            f"over {len(ranks)} ranks"
        )
        for rank in ranks:
            mine = [e for e in timeline if e["pid"] == rank]
            window = next(e for e in mine if e["args"]["kind"] == "step")
            busy = sum(e["dur"] for e in mine if e["args"]["kind"] in COLORS and len(e["args"]["kind"]) == 1)
            lines.append(f"    rank {rank}: busy {busy / 1e3:8.2f} ms of {window['dur'] / 1e3:8.2f} ms")
    elif (run_dir / "trace.json").exists():
        lines.append("  no pipeline timeline in trace.json (pp = 1?)")
    else:  # written when a run ends: one stopped early has none
        lines.append("  no trace.json: the run did not finish (train writes it, with the ledger, at the end)")
    return "\n".join(lines)


def _bytes(n: float) -> str:
    from fivefold.plan.text import byte_unit

    size, unit = byte_unit(abs(n))
    return f"{n:.0f} B" if unit == "B" else f"{n / size:.1f} {unit}"


# ---- SVG, by hand


def predicted_timeline(config_path: Path) -> list[dict]:
    """The run's schedule replayed from torch's action table (1:2 costs), as timeline events."""
    from fivefold.config import RunConfig
    from fivefold.explore.timeline import drawn_microbatches
    from fivefold.measure.bubble import simulated_bubble

    try:
        layout = RunConfig.from_toml(config_path).layout
        # torch's action table grows faster than linearly in m: a long step is replayed with the
        # micro-batches `explore` draws at most
        drawn = drawn_microbatches(layout.pp, layout.microbatches)
        sim = simulated_bubble(layout.pp_schedule, layout.pp, drawn, layout.virtual_stages, "1:2")
    except (FivefoldError, ValueError, OSError):
        return []
    unit = 1000.0  # one forward of a whole stage drawn as 1 ms
    events = []
    for rank, ops in enumerate(sim.timeline):
        events.append(
            {
                "name": "step",
                "ts": 0.0,
                "dur": sim.makespan * unit,
                "pid": rank,
                "args": {
                    "kind": "step",
                    "step": "predicted",
                    "pp_rank": rank,
                    "idle": sim.idle_fraction,
                    "drawn": drawn,
                    "microbatches": layout.microbatches,
                },
            }
        )
        for start, end, (stage, kind, mb) in ops:
            events.append(
                {
                    "name": f"{stage}{kind}{mb}",
                    "ts": start * unit,
                    "dur": (end - start) * unit,
                    "pid": rank,
                    "args": {"kind": kind, "step": "predicted", "pp_rank": rank},
                }
            )
    return events


def _predicted_idle(predicted: list[dict]) -> str:
    """The replayed idle fraction, and how many of the step's micro-batches it replayed if not all."""
    args = predicted[0]["args"]
    drawn, m = args.get("drawn"), args.get("microbatches")
    of = f" with {drawn} of its {m} micro-batches" if drawn and m and drawn < m else ""
    return f"{args['idle']:.3f}{of}"


def render_svg(
    metrics: list[dict],
    timeline: list[dict],
    ledger: Any,
    title: str = "",
    predicted: list[dict] | None = None,
) -> str:
    width = 960
    parts: list[str] = []
    y = 40
    parts.append(f'<text x="20" y="24" font-size="16" font-weight="bold">{escape(title)}</text>')
    if metrics:
        parts.append(_svg_loss(metrics, 20, y, width - 40, 220))
        y += 250
    if timeline:
        block, height = _svg_timeline(timeline, 20, y, width - 40)
        parts.append(block)
        y += height + 20
    if predicted:
        heading = (
            f"predicted from the schedule's action table (F = 1, B = 2 = I + W; "
            f"idle {_predicted_idle(predicted)})"
        )
        block, height = _svg_timeline(predicted, 20, y, width - 40, heading=heading)
        parts.append(block)
        y += height + 20
    height = y + 10
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">\n<rect width="100%" height="100%" fill="white"/>\n'
        + "\n".join(parts)
        + "\n</svg>\n"
    )


def _svg_loss(metrics: list[dict], x0: float, y0: float, w: float, h: float) -> str:
    # a diverged step (NaN or infinite loss) has no place on the axes: it is left out of the curve
    finite = [m for m in metrics if math.isfinite(m["step"]) and math.isfinite(m["loss"])]
    steps = [m["step"] for m in finite] or [0]
    losses = [m["loss"] for m in finite]
    held = [
        (m["step"], m["held_out_loss"])
        for m in finite
        if m.get("held_out_loss") is not None and math.isfinite(m["held_out_loss"])
    ]
    values = losses + [v for _, v in held] or [0.0]
    lo, hi, s0, s1 = min(values), max(values), min(steps), max(steps)
    # spans of one value (one step, a flat loss) or below float resolution draw as a unit span
    value_span = hi - lo if hi - lo > 0 else 1.0
    step_span = s1 - s0 if s1 - s0 > 0 else 1.0
    left, bottom = x0 + 50, y0 + h - 20

    def px(step: float, value: float) -> tuple[float, float]:
        return (
            left + (step - s0) / step_span * (w - 60),
            y0 + 10 + (hi - value) / value_span * (h - 40),
        )

    out = [
        f'<text x="{x0}" y="{y0}" font-size="13" font-weight="bold">loss</text>',
        f'<line x1="{left}" y1="{bottom}" x2="{x0 + w}" y2="{bottom}" stroke="#888"/>',
        f'<line x1="{left}" y1="{y0 + 10}" x2="{left}" y2="{bottom}" stroke="#888"/>',
        # each value's label on the level the curve reaches it at (4 px lower: a text's baseline)
        f'<text x="{x0}" y="{px(s0, hi)[1] + 4:.1f}">{hi:.3f}</text>',
        f'<text x="{x0}" y="{px(s0, lo)[1] + 4:.1f}">{lo:.3f}</text>',
        f'<text x="{left}" y="{bottom + 14}">step {s0}</text>',
        f'<text x="{x0 + w - 60}" y="{bottom + 14}">step {s1}</text>',
    ]
    points = " ".join(f"{a:.1f},{b:.1f}" for a, b in (px(s, v) for s, v in zip(steps, losses)))
    out.append(f'<polyline points="{points}" fill="none" stroke="#4e79a7" stroke-width="1.5"/>')
    for s, v in held:
        a, b = px(s, v)
        out.append(
            f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="#e15759"><title>held-out {v:.4f}</title></circle>'
        )
    out.append(
        f'<text x="{x0 + w - 200}" y="{y0 + 12}" fill="#4e79a7">train</text>'
        f'<text x="{x0 + w - 150}" y="{y0 + 12}" fill="#e15759">● held-out</text>'
    )
    return "\n".join(out)


def _svg_timeline(
    timeline: list[dict], x0: float, y0: float, w: float, heading: str | None = None
) -> tuple[str, float]:
    ranks = sorted({e["pid"] for e in timeline})
    windows = [e for e in timeline if e["args"]["kind"] == "step"]
    t0 = min(e["ts"] for e in windows)
    t1 = max(e["ts"] + e["dur"] for e in windows)
    row_h, left = 26, x0 + 70
    scale = (w - 80) / max(t1 - t0, 1e-9)
    step = timeline[0]["args"]["step"]
    heading = heading or f"pipeline, step {step} (measured; {(t1 - t0) / 1e3:.1f} ms)"
    out = [f'<text x="{x0}" y="{y0}" font-size="13" font-weight="bold">{escape(heading)}</text>']
    for row, rank in enumerate(ranks):
        y = y0 + 12 + row * row_h
        pp = next((e["args"].get("pp_rank") for e in timeline if e["pid"] == rank), "?")
        out.append(f'<text x="{x0}" y="{y + 16}">rank {rank} (pp {pp})</text>')
        out.append(
            f'<rect x="{left}" y="{y}" width="{(t1 - t0) * scale:.1f}" height="{row_h - 4}" '
            'fill="white" stroke="#ccc"/>'
        )
        for e in timeline:
            kind = e["args"]["kind"]
            if e["pid"] != rank or kind not in COLORS:
                continue
            x, width = left + (e["ts"] - t0) * scale, max(e["dur"] * scale, 0.5)
            comm = kind in ("send", "recv", "send/recv")
            top, height = (y + row_h - 10, 5) if comm else (y, row_h - 4)
            label = f"{e['name']} {e['dur'] / 1e3:.2f} ms"
            out.append(
                f'<rect x="{x:.2f}" y="{top}" width="{width:.2f}" height="{height}" '
                f'fill="{COLORS[kind]}" stroke="white" stroke-width="0.3">'
                f"<title>{escape(label)}</title></rect>"
            )
            if not comm and width > 22:
                text = e["name"].lstrip("0123456789") if width < 34 else e["name"]
                out.append(
                    f'<text x="{x + 2:.1f}" y="{y + 15}" fill="white" font-size="9">{escape(text)}</text>'
                )
    y = y0 + 20 + len(ranks) * row_h
    for i, (kind, text) in enumerate(LEGEND):
        fill = COLORS.get(kind, "white")
        out.append(
            f'<rect x="{left + i * 140}" y="{y}" width="12" height="12" fill="{fill}" stroke="#888"/>'
            f'<text x="{left + i * 140 + 16}" y="{y + 10}">{escape(text)}</text>'
        )
    return "\n".join(out), len(ranks) * row_h + 40


# ---- PNG through matplotlib


def render_png(metrics: list[dict], timeline: list[dict], out: Path, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise FivefoldError(
            "PNG output needs matplotlib (pip install 'fivefold[plot]'); use --out FILE.svg"
        ) from None
    panels = [p for p in ("loss" if metrics else None, "timeline" if timeline else None) if p]
    if not panels:
        raise FivefoldError("nothing to draw: no metrics.jsonl and no pipeline timeline in the run directory")
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), dpi=110, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        if panel == "loss":
            ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1.2, label="train")
            held = [m for m in metrics if m.get("held_out_loss") is not None]
            if held:
                ax.plot(
                    [m["step"] for m in held],
                    [m["held_out_loss"] for m in held],
                    "o-",
                    ms=4,
                    label="held-out",
                )
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("loss")
            ax.legend()
            ax.set_title(title)
            continue
        ranks = sorted({e["pid"] for e in timeline})
        t0 = min(e["ts"] for e in timeline if e["args"]["kind"] == "step")
        for row, rank in enumerate(ranks):
            for e in timeline:
                kind = e["args"]["kind"]
                if e["pid"] != rank or kind not in COLORS:
                    continue
                comm = kind in ("send", "recv", "send/recv")
                band = (row - 0.1, 0.2) if comm else (row - 0.4, 0.8)
                ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], band, facecolors=COLORS[kind])
        pp_of = {e["pid"]: e["args"].get("pp_rank") for e in timeline}
        ax.set_yticks(range(len(ranks)), [f"rank {r} (pp {pp_of[r]})" for r in ranks])
        ax.invert_yaxis()
        ax.set_xlabel("ms since the step began")
        ax.set_title(f"pipeline, step {timeline[0]['args']['step']} (white: idle)")
        ax.legend(
            handles=[Patch(color=COLORS.get(k, "white"), label=t) for k, t in LEGEND if k != "idle"],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.22),
            fontsize=8,
            ncol=5,
            frameon=False,
        )
    fig.tight_layout()
    # the picture's format by its name (png, pdf, ...), written whole: a full disk leaves no cut file
    fmt = out.suffix.lstrip(".").lower() or "png"
    try:
        write_whole(out, lambda target: fig.savefig(target, format=fmt))
    finally:
        plt.close(fig)
