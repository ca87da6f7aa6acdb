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
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LOAD = re.compile(r"^## (\S+) (titan|fivefold) (\S+) \(load ([\d.]+) ([\d.]+) ([\d.]+)\)")


def run_kit(args: argparse.Namespace, out: Path) -> Path:
    """Run the kit's compare.sh from the project root; returns the path of its console log."""
    env = dict(os.environ)
    env.update(
        OUT=str(out),
        STEPS=str(args.steps),
        WARMUP=str(args.warmup),
        SEQ=str(args.seq),
        LBS=str(args.lbs),
        CASES=args.cases,
        DTYPES=args.dtypes,
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


def table(results: Path, log: Path, title: str) -> str:
    load = loads(log)
    header = next((ln for ln in log.read_text().splitlines() if ln.startswith("# compare.sh")), "")
    lines = [
        f"### {title}",
        "",
        f"`{header.lstrip('# ')}`" if header else "",
        "",
        "| case | dtype | tokens/step | TorchTitan tok/s | fivefold tok/s | ratio "
        "| load at start (titan / fivefold) |",
        "|---|---|---|---|---|---|---|",
    ]
    for raw in results.read_text().splitlines():
        if not raw.strip():
            continue
        row = json.loads(raw)
        case, dtype = row["case"], row["dtype"]
        if "na" in row:
            lines.append(f"| {case} | {dtype} | - | n/a | n/a | - | {row['na']} |")
            continue
        res = row["res"]
        titan, ff = res["titan"], res["fivefold"]
        ratio = f"**{res['ratio']:.3f}**" if "ratio" in res else "-"
        tag = f"{case}_{dtype}"

        def rate(d: dict) -> str:
            return f"{d['tok_s']:,.0f}" if "tok_s" in d else f"FAIL ({d.get('error', '?')})"

        tokens = ff.get("tokens_per_step", titan.get("tokens_per_step", "?"))
        where = f"{load.get(('titan', tag), '?')} / {load.get(('fivefold', tag), '?')}"
        lines.append(f"| {case} | {dtype} | {tokens} | {rate(titan)} | {rate(ff)} | {ratio} | {where} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", help="folder holding the kit's compare.sh (set up with its setup.sh)")
    parser.add_argument("--from", dest="source", help="read a finished kit run (its OUT folder) instead")
    parser.add_argument("--log", help="the kit's console log (with --from; default OUT/compare.log)")
    parser.add_argument("--fivefold", default=".venv/bin/fivefold", help="fivefold executable")
    parser.add_argument("--steps", type=int, default=7, help="steps per run (median of those after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--lbs", type=int, default=8, help="sequences per data-parallel rank per step")
    parser.add_argument("--cases", default="np1 fsdp2 tp2 pp2")
    parser.add_argument("--dtypes", default="fp32 bf16")
    parser.add_argument("--compile", action="store_true", help="both systems compiled")
    parser.add_argument("--title", default="fivefold ÷ TorchTitan tokens/s")
    parser.add_argument("--md", help="append the table to this Markdown file (default: print it)")
    args = parser.parse_args()
    if args.source:
        out = Path(args.source)
        log = Path(args.log) if args.log else out / "compare.log"
    elif args.kit:
        out = Path(tempfile.mkdtemp(prefix="bench-vs-torchtitan-"))
        log = run_kit(args, out)
    else:
        print("bench_vs_torchtitan: give --kit DIR (run the kit) or --from OUT (read a run)", file=sys.stderr)
        return 2
    text = table(out / "results.jsonl", log, args.title)
    if args.md:
        with open(args.md, "a") as sink:
            sink.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
