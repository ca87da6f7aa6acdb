"""The planner against fivefold's own runs on one device: as shipped, and calibrated on one run.

Trains six layouts of one model on one device with `fivefold train` (eager micro-batches 4 and 2,
twice the sequence, micro-batch 8 with full recompute, 4 accumulated micro-batches, and compiled),
then predicts each run directory's median step time twice: with the knobs fivefold ships, and
with the knobs `fivefold plan --calibrate` fits to the first run alone. The second column is what a
user gets from one calibration run on their own machine; the table in docs/planner.md
(Calibration knobs) came from this script on an H200.

The same from the command line, on the run directories this leaves with `--keep-runs DIR`:

    fivefold plan --validate DIR/*                          # as shipped
    fivefold plan --calibrate DIR/eager-mb4 --out cal.toml  # fit on one run
    fivefold plan --validate DIR/* --hardware cal.toml      # the others on the fitted file

Without a CUDA GPU it says so and exits 0, unless `--device cpu` asks for a run here (with a small
`--model`, e.g. `tiny`, this is how the script is tested).

Run: python benchmarks/bench_plan_vs_run.py [--device cuda|cpu] [--model TOML|PRESET] [--steps 10]
     [--seq 2048] [--no-compile] [--keep-runs DIR] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# name -> (micro-batch, global batch, sequence multiple, extra flags)
LAYOUTS: dict[str, tuple[int, int, int, list[str]]] = {
    "eager-mb4": (4, 4, 1, []),
    "eager-mb2": (2, 2, 1, []),
    "eager-long": (2, 2, 2, []),
    "eager-full-mb8": (8, 8, 1, ["--recompute", "full"]),
    "eager-accum4": (2, 8, 1, []),
    "compiled-mb2": (2, 2, 1, ["--compile"]),
}


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import MODEL, model_toml, train_command  # noqa: E402  (a sibling script)


def default_model(tmp: Path) -> str:
    """Llama 3.2 1B's shape (the model of benchmarks/bench_gpu.py), as a model TOML."""
    return str(model_toml(MODEL, tmp / "llama-1b.toml"))


def train(name: str, model: str, args: argparse.Namespace, out: Path) -> Path | str:
    """One layout's run directory, or the error's last line."""
    micro, batch, seq_times, extra = LAYOUTS[name]
    run_dir = out / name
    seq = args.seq * seq_times
    command = train_command(model, run_dir, args.device, args.dtype, args.steps, seq, micro, batch) + extra
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return (done.stderr or done.stdout).strip().splitlines()[-1]
    return run_dir


def compare(run_dirs: list[Path]) -> list[dict]:
    """Per run: measured step, and the error of the plan as shipped and after calibrating on the
    first run (predicted ÷ measured throughput − 1, as `plan --validate` prints it)."""
    from fivefold.plan import validation as V
    from fivefold.plan.runs import run_from_dir

    cases = V.cases([run_from_dir(d) for d in run_dirs])
    fitted = V.fit(cases[:1]).apply(cases[0].inputs.hw)
    rows = []
    for case, on_fitted in zip(cases, V.on_hardware(cases, fitted)):
        shipped = V.predict(case)  # its `published` is the run's median step after the first
        rows.append(
            {
                "run": case.id,
                "measured_step_s": shipped.published,
                "shipped": shipped.error,
                "calibrated": V.predict(on_fitted).error,
            }
        )
    return rows


def table(rows: list[dict], failed: dict[str, str], first: str) -> str:
    lines = [
        f"| run | measured step | as shipped | calibrated on `{first}` alone |",
        "|---|---|---|---|",
    ]
    for r in rows:
        fitted = " (fitted)" if r["run"] == first else ""
        cells = (
            r["run"],
            f"{r['measured_step_s']:.4g} s",
            f"{r['shipped']:+.1%}",
            f"{r['calibrated']:+.1%}{fitted}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    for name, error in failed.items():
        lines.append(f"| {name} | failed: {error[:100]} | | |")
    held_out = [abs(r["calibrated"]) for r in rows if r["run"] != first]
    if held_out:
        lines.append("")
        worst, mean = max(held_out), statistics.mean(held_out)
        lines.append(f"- calibrated on one run, the others: worst {worst:.1%}, mean {mean:.1%}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", help="model preset or TOML (default: Llama 3.2 1B's shape)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence (eager-long: twice)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled layout")
    parser.add_argument("--keep-runs", help="copy the run directories here")
    parser.add_argument("--md", help="append the table to this Markdown file")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_plan_vs_run: no CUDA GPU here; nothing to measure (--device cpu runs here)")
        return 0
    names = [n for n in LAYOUTS if not (args.no_compile and "--compile" in LAYOUTS[n][3])]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model = args.model or default_model(out)
        run_dirs, failed = [], {}
        for name in names:
            result = train(name, model, args, out)
            if not isinstance(result, Path):
                failed[name] = result
                print(f"{name}: failed: {result}", flush=True)
                continue
            run_dirs.append(result)
            if args.keep_runs:  # kept as each finishes, so that a run cut short leaves the ones done
                shutil.copytree(result, Path(args.keep_runs) / result.name, dirs_exist_ok=True)
            if run_dirs[0].name != names[0]:
                print(f"{name}: trained", flush=True)
                continue
            row = compare(run_dirs)[-1]  # the row so far, calibrated on the first run
            print(
                f"{name}: trained, step {row['measured_step_s']:.4g} s, plan {row['shipped']:+.1%} as "
                f"shipped, {row['calibrated']:+.1%} calibrated on {names[0]}",
                flush=True,
            )
        if not run_dirs or run_dirs[0].name != names[0]:
            print(f"bench_plan_vs_run: {names[0]} did not train; nothing to calibrate on", file=sys.stderr)
            return 1
        text = table(compare(run_dirs), failed, names[0])
    print(text)
    if args.md:
        with open(args.md, "a") as fh:
            fh.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
