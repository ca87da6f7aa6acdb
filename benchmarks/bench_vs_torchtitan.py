"""fivefold vs TorchTitan tokens/s, side by side: runs the TorchTitan comparison kit, writes a table.

The kit (a `compare.sh` beside TorchTitan's CPU shim, set up once with its `setup.sh`) trains the
same model (TorchTitan's llama3 debug model) in both systems, with the same layout, precision,
tokens per step and data, back to back per case, alternating which runs first. This script runs it
(or reads a finished run with --from), then writes a Markdown table: tokens/s of each, the ratio
fivefold ÷ TorchTitan (> 1: fivefold faster), and the load average at the start of each run, which
on a shared machine says how far to trust a row.

    python benchmarks/bench_vs_torchtitan.py --kit PATH/TO/torchtitan-kit [--steps 7] [--seq 2048]
        [--lbs 8] [--cases "np1 fsdp2 tp2 pp2"] [--dtypes "fp32 bf16"] [--compile] [--md OUT.md]
    python benchmarks/bench_vs_torchtitan.py --from KIT_OUTPUT_DIR --log compare.log [--md OUT.md]

`--compile` passes fivefold `--compile` and TorchTitan `--compile.enable` to every run.
`--rounds N` runs the kit N times back to back and pools the steps after warm-up of every round:
the table then gives the median over all of them and each round's own ratio, so a reader sees how
far one round on a shared machine moves. Every second round orders the cases so that each cell
runs the other system first: whichever side running first favours, no cell always gets it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

LOAD = re.compile(r"^## (\S+) (titan|fivefold) (\S+) \(load ([\d.]+) ([\d.]+) ([\d.]+)\)")


NO_BF16 = ("tp2", "pp2")  # TorchTitan 0.2.2 has no bf16 without FSDP beyond one process


def _titan_first(cases: list[str], dtypes: list[str]) -> dict[tuple[str, str], bool]:
    """Which cells the kit runs TorchTitan first in: it alternates over the cells it measures."""
    cells = [(c, d) for c in cases for d in dtypes if not (d == "bf16" and c in NO_BF16)]
    return {cell: i % 2 == 0 for i, cell in enumerate(cells)}


def flipped_order(cases: str, dtypes: str) -> tuple[str, str]:
    """An order of the cases and dtypes in which every cell runs the other system first than in the
    given order, so that pooled rounds do not always favour the same side of a cell; the given order
    where no such order exists."""
    c0, d0 = cases.split(), dtypes.split()
    first = _titan_first(c0, d0)
    for c in itertools.permutations(c0):
        for d in itertools.permutations(d0):
            other = _titan_first(list(c), list(d))
            if all(other[cell] != first[cell] for cell in first):
                return " ".join(c), " ".join(d)
    return cases, dtypes


def run_kit(args: argparse.Namespace, out: Path, flip: bool = False) -> Path:
    """Run the kit's compare.sh from the project root; returns the path of its console log. With
    `flip` every cell runs the other system first (see `flipped_order`)."""
    cases, dtypes = flipped_order(args.cases, args.dtypes) if flip else (args.cases, args.dtypes)
    env = dict(os.environ)
    env.update(
        OUT=str(out),
        STEPS=str(args.steps),
        WARMUP=str(args.warmup),
        SEQ=str(args.seq),
        LBS=str(args.lbs),
        CASES=cases,
        DTYPES=dtypes,
        FIVEFOLD=str(Path(args.fivefold).resolve()),
    )
    if args.compile:
        env["FF_EXTRA"] = (env.get("FF_EXTRA", "") + " --compile").strip()
        env["TITAN_EXTRA"] = (env.get("TITAN_EXTRA", "") + " --compile.enable").strip()
    log = out / "compare.log"
    out.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        subprocess.run(
            ["bash", str(Path(args.kit) / "compare.sh")], env=env, stdout=sink, stderr=sink, check=False
        )
    return log


def loads(log: Path) -> dict[tuple[str, str], str]:
    """(system, case_dtype) -> the 1-minute load average when that run started."""
    found = {}
    for line in log.read_text().splitlines():
        m = LOAD.match(line)
        if m:
            found[(m.group(2), m.group(3))] = m.group(4)
    return found


def _rounds(outs: list[tuple[Path, Path]]) -> tuple[dict, dict]:
    """Per (case, dtype): the rows of every round, and the start loads of every round."""
    rows: dict[tuple[str, str], list[dict]] = {}
    starts: dict[tuple[str, str], list[str]] = {}
    for results, log in outs:
        load = loads(log)
        for raw in results.read_text().splitlines():
            if not raw.strip():
                continue
            row = json.loads(raw)
            key = (row["case"], row["dtype"])
            rows.setdefault(key, []).append(row)
            tag = f"{row['case']}_{row['dtype']}"
            starts.setdefault(key, []).append(
                f"{load.get(('titan', tag), '?')} / {load.get(('fivefold', tag), '?')}"
            )
    return rows, starts


def _pooled(runs: list[dict]) -> float | None:
    """Median tokens/s over the measured steps of every round (None if a round failed)."""
    steps = [v for run in runs for v in run.get("per_step_tok_s", [])]
    if any("tok_s" not in run for run in runs) or not steps:
        return None
    return median(steps)


def order_balanced(found: list[dict]) -> float | None:
    """The ratio with the run order cancelled: the geometric mean of the rounds in which TorchTitan
    ran first and of those in which fivefold did, each side averaged geometrically (None unless the
    rounds hold both orders). The first run of a cell meets whatever the machine did just before,
    so one round's ratio can carry a bias of either sign; rounds in both orders cancel it."""
    by_first: dict[str, list[float]] = {}
    for r in found:
        if "ratio" in r.get("res", {}) and r.get("first") in ("titan", "fivefold"):
            by_first.setdefault(r["first"], []).append(r["res"]["ratio"])
    if len(by_first) < 2:
        return None
    sides = [math.exp(sum(map(math.log, v)) / len(v)) for v in by_first.values()]
    return math.sqrt(sides[0] * sides[1])


def table(outs: list[tuple[Path, Path]], title: str) -> str:
    header = next((ln for ln in outs[0][1].read_text().splitlines() if ln.startswith("# compare.sh")), "")
    rows, starts = _rounds(outs)
    many = len(outs) > 1
    pooled = f" · {len(outs)} rounds, steps pooled" if many else ""
    lines = [
        f"### {title}",
        "",
        f"`{header.lstrip('# ')}`{pooled}" if header else "",
        "",
        "| case | dtype | tokens/step | TorchTitan tok/s | fivefold tok/s | ratio "
        + ("| ratio per round (who ran first) | both orders " if many else "")
        + "| load at start (titan / fivefold) |",
        "|---|---|---|---|---|---|---|" + ("---|---|" if many else ""),
    ]
    for (case, dtype), found in rows.items():
        if "na" in found[0]:
            gap = " - | - |" if many else ""
            lines.append(f"| {case} | {dtype} | - | n/a | n/a | - |{gap} {found[0]['na']} |")
            continue
        titan_runs = [r["res"]["titan"] for r in found]
        ff_runs = [r["res"]["fivefold"] for r in found]
        titan, ff = _pooled(titan_runs), _pooled(ff_runs)

        def rate(value: float | None, runs: list[dict]) -> str:
            if value is not None:
                return f"{value:,.0f}"
            return "FAIL (" + "; ".join(r.get("error", "?") for r in runs if "tok_s" not in r) + ")"

        ratio = f"**{ff / titan:.3f}**" if ff is not None and titan else "-"
        per_round = ", ".join(
            f"{r['res']['ratio']:.3f} ({'T' if r.get('first') == 'titan' else 'F'})"
            if "ratio" in r["res"]
            else "-"
            for r in found
        )
        balanced = order_balanced(found)
        tokens = ff_runs[0].get("tokens_per_step", titan_runs[0].get("tokens_per_step", "?"))
        cells = [case, dtype, str(tokens), rate(titan, titan_runs), rate(ff, ff_runs), ratio]
        if many:
            cells += [per_round, f"**{balanced:.3f}**" if balanced else "-"]
        cells.append("; ".join(starts[(case, dtype)]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", help="folder holding the kit's compare.sh (set up with its setup.sh)")
    parser.add_argument(
        "--from", dest="source", help="read finished kit runs (their OUT folders, comma-separated) instead"
    )
    parser.add_argument("--log", help="the kit's console log (with --from; default OUT/compare.log)")
    parser.add_argument("--fivefold", default=".venv/bin/fivefold", help="fivefold executable")
    parser.add_argument("--steps", type=int, default=7, help="steps per run (median of those after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--lbs", type=int, default=8, help="sequences per data-parallel rank per step")
    parser.add_argument("--cases", default="np1 fsdp2 tp2 pp2")
    parser.add_argument("--dtypes", default="fp32 bf16")
    parser.add_argument("--compile", action="store_true", help="both systems compiled")
    parser.add_argument("--rounds", type=int, default=1, help="run the kit this many times, pool the steps")
    parser.add_argument("--title", default="fivefold ÷ TorchTitan tokens/s")
    parser.add_argument("--md", help="append the table to this Markdown file (default: print it)")
    args = parser.parse_args()
    outs: list[tuple[Path, Path]] = []
    if args.source:
        for source in args.source.split(","):
            out = Path(source)
            outs.append((out / "results.jsonl", Path(args.log) if args.log else out / "compare.log"))
    elif args.kit:
        for round_index in range(max(args.rounds, 1)):
            out = Path(tempfile.mkdtemp(prefix="bench-vs-torchtitan-"))
            outs.append((out / "results.jsonl", run_kit(args, out, flip=round_index % 2 == 1)))
    else:
        print("bench_vs_torchtitan: give --kit DIR (run the kit) or --from OUT (read a run)", file=sys.stderr)
        return 2
    text = table(outs, args.title)
    if args.md:
        with open(args.md, "a") as sink:
            sink.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
