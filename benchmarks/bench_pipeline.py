"""Pipeline schedules side by side on CPU ranks: step time (ratio to 1F1B), measured idle fraction
against the action-table prediction, and peak activation memory per stage (why 1F1B exists).

    .venv/bin/python benchmarks/bench_pipeline.py            # 4 ranks, pp 4, 8 micro-batches
    .venv/bin/python benchmarks/bench_pipeline.py --table    # only the bubble table (no processes)

Every schedule runs the same model (8 layers, so pp 4 × 2 virtual stages is possible) on the same
batches; each rank uses one thread. Times are medians over the timed steps of `forward_backward`
(the schedule itself; no optimizer). Activation memory is the peak of bytes saved for backward and
alive together on a rank (fivefold.measure.memory.ActivationMeter), i.e. per pp stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the shared spawn helper

SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("zero-bubble", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]


def _body(rank: int, world: int, opts: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    from fivefold.config import Layout, TrainSpec, load_model
    from fivefold.measure.memory import ActivationMeter
    from fivefold.measure.timeline import gather_events, idle_fraction
    from fivefold.model import build_model
    from fivefold.parallel.device_mesh import build_runtime_mesh
    from fivefold.parallel.runners import build_runner

    spec = dataclasses.replace(
        load_model("tiny"),
        layers=8,
        hidden=opts["hidden"],
        heads=8,
        kv_heads=4,
        ffn_hidden=4 * opts["hidden"],
        max_seq_len=opts["seq"],
    )
    out = []
    for schedule, v in SCHEDULES:
        if opts["only"] and schedule not in opts["only"]:
            continue
        m = opts["microbatches"]
        layout = Layout(pp=world, pp_schedule=schedule, virtual_stages=v, microbatches=m).resolve(world)
        train = TrainSpec(seq_len=opts["seq"], micro_batch=m * opts["micro"], seed=0)
        mesh = build_runtime_mesh(layout, "cpu")
        runner = build_runner(build_model(spec), mesh, layout, train)
        gen = torch.Generator().manual_seed(0)
        times, peaks = [], []
        for step in range(opts["warmup"] + opts["steps"]):
            x = torch.randint(0, spec.vocab, (m * opts["micro"], opts["seq"]), generator=gen)
            dist.barrier()
            t0 = time.perf_counter()
            with ActivationMeter() as meter:
                runner.forward_backward(x, x)
            dist.barrier()
            if step >= opts["warmup"]:
                times.append(time.perf_counter() - t0)
                peaks.append(meter.peak_bytes)
            for part in runner.model_parts:
                part.zero_grad(set_to_none=True)
        events = gather_events(runner.timeline)
        out.append(
            {
                "schedule": schedule,
                "v": v,
                "m": m,
                "time": statistics.median(times),
                "peak": max(peaks),
                "stages": runner.stage_ids,
                "idle": idle_fraction(events) if events is not None else None,
            }
        )
        del runner
    return out


def bubble_rows(p: int, m: int) -> list[str]:
    from fivefold.measure.bubble import bubble_table

    cases = []
    for pp in (2, 4, 8):
        for micro in (pp, 2 * pp, 4 * pp):
            for schedule, v in SCHEDULES + [("interleaved-1f1b", 4), ("zero-bubble", 1)]:
                if schedule == "dualpipev" and micro < 2 * pp:
                    continue
                cases.append((schedule, pp, micro, v))
    rows = [
        f"{'schedule':<17}{'p':>3}{'m':>4}{'V':>3}  {'table unit':>10} {'closed':>7}  {'table 1:2':>9} "
        f"{'closed':>7}  published 1:2"
    ]
    for r in bubble_table(cases):
        pub = f"{r['published 1:2']:.4f}" if "published 1:2" in r else ""
        rows.append(
            f"{r['schedule']:<17}{r['p']:>3}{r['m']:>4}{r['V']:>3}  {r['table unit']:>10.4f} "
            f"{r['closed unit']:>7.4f}  {r['table 1:2']:>9.4f} {r['closed 1:2']:>7.4f}  {pub}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--table", action="store_true", help="print only the bubble table")
    args = parser.parse_args()
    print("bubble from torch's action tables vs closed forms (idle fraction)")
    print("\n".join(bubble_rows(args.nproc, args.microbatches)))
    if args.table:
        return
    from distributed import run_distributed
    from fivefold.measure.bubble import simulated_bubble

    keys = ("microbatches", "micro", "seq", "hidden", "steps", "warmup", "only")
    opts = {k: getattr(args, k) for k in keys}
    results = run_distributed(_body, args.nproc, opts, timeout=1800)
    base = next((r["time"] for r in results[0] if r["schedule"] == "1f1b"), None)
    p, m = args.nproc, args.microbatches
    print(
        f"\n{p} CPU ranks, pp {p}, {m} micro-batches of {args.micro}×{args.seq} tokens, "
        f"hidden {args.hidden}, 8 layers; median forward_backward"
    )
    print(
        f"{'schedule':<17}{'V':>2} {'step ms':>9} {'/1F1B':>6} {'idle meas.':>10} {'idle table':>10}  "
        "peak activations per pp rank (MiB)"
    )
    for i, row in enumerate(results[0]):
        predicted = simulated_bubble(row["schedule"], p, m, row["v"], "1:2").idle_fraction
        peaks = " ".join(f"{results[r][i]['peak'] / 2**20:6.2f}" for r in range(p))
        ratio = f"{row['time'] / base:6.2f}" if base else "   n/a"
        print(
            f"{row['schedule']:<17}{row['v']:>2} {row['time'] * 1e3:9.1f} {ratio} {row['idle']:10.3f} "
            f"{predicted:10.3f}  {peaks}"
        )


if __name__ == "__main__":
    main()
