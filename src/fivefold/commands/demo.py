"""`fivefold demo`: the default job — train the `small` model on the embedded corpus.

The corpus is the running interpreter's standard library (no download); the tokenizer is
byte-level, so the loss starts near ln(256) = 5.55 nats and a working set-up ends far below it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from fivefold.commands.train import default_run_dir, start
from fivefold.config import Layout, RunConfig, TrainSpec, load_model
from fivefold.errors import FivefoldError, reason
from fivefold.train.launch import TrainJob
from fivefold.train.loop import check_run_dir, train

DEMO_MODEL = "small"
# 200 steps of 8×128 bytes take about 0.15 CPU-seconds each and end near 2 nats held-out (~60% below
# ln 256); the loss is under the 3.33 bar from about step 30 on.
DEMO_TRAIN = TrainSpec(steps=200, eval_every=50)
# by default the same job on 4 CPU ranks: sharded 2 ways (FSDP) × split 2 ways (TP); each of the
# 2 data-parallel ranks takes half of the same 8-sequence global batch
DEMO_NPROC = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", default=None, help="run directory (default runs/demo-<time>)")
    parser.add_argument(
        "--steps", type=int, default=None, help=f"optimizer steps (default {DEMO_TRAIN.steps})"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--nproc",
        type=int,
        default=DEMO_NPROC,
        help=f"CPU ranks (default {DEMO_NPROC}: fsdp 2 × tp 2; 2: fsdp 2; 1: a single process)",
    )


def run(args: argparse.Namespace) -> int:

    started = time.perf_counter()
    if args.nproc < 1:  # else taken for one process, as if 1 had been given
        raise FivefoldError(f"--nproc must be 1, 2, 4 or 8 (CPU ranks), got {args.nproc}")
    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        # a model this small gains little from a second thread, and threads that spin-wait for each
        # other slow down tenfold on a machine whose cores are busy with anything else
        torch.set_num_threads(1)
    spec = load_model(DEMO_MODEL)
    tspec = DEMO_TRAIN
    if args.steps is not None:
        tspec = replace(tspec, steps=args.steps)
    if args.seed is not None:
        tspec = replace(tspec, seed=args.seed)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir("demo")
    # the demo has no --resume: a run found there is continued by `fivefold train`
    check_run_dir(run_dir, None, f"continue it with `fivefold train --resume --run-dir {run_dir}`")
    try:  # made now, so that a place no file can be written is said before four ranks start
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FivefoldError(
            f"--run-dir {run_dir}: cannot make the run directory there ({reason(exc)})"
        ) from None
    print(
        f"training {spec.name} ({spec.num_params() / 1e6:.2f} M parameters) for {tspec.steps} steps "
        f"on the Python standard library's sources, byte-level; run directory: {run_dir}",
        flush=True,
    )
    if args.nproc > 1:
        return _run_layout(args, spec, tspec, run_dir, started)
    result = train(RunConfig(model=spec, train=tspec.validate()), run_dir, progress=not args.no_progress)
    ln_vocab = math.log(spec.vocab)
    held = result.held_out_loss if result.held_out_loss is not None else float("nan")
    print(
        f"held-out loss {held:.3f} nats/token vs ln(vocab) = {ln_vocab:.3f}: "
        f"{1 - held / ln_vocab:.0%} below ({time.perf_counter() - started:.0f} s)"
    )
    print(
        f"run directory: {result.run_dir}  (config.toml, metrics.jsonl, loss.png, trace.json, checkpoints/)"
    )
    return 0


def _run_layout(args: argparse.Namespace, spec, tspec: TrainSpec, run_dir, started: float) -> int:
    """The demo on `--nproc` CPU ranks through `fivefold train`'s launcher, then the ledger table."""

    layout = {"fsdp": 2, "tp": 2} if args.nproc == 4 else {"fsdp": args.nproc}
    global_batch = tspec.global_batch or tspec.micro_batch
    if global_batch % layout["fsdp"]:
        raise FivefoldError(
            f"--nproc {args.nproc}: the demo's {global_batch} sequences per step do not split over "
            f"{layout['fsdp']} data-parallel ranks; use --nproc 1, 2, 4 or 8"
        )
    config = RunConfig(
        model=spec,
        train=replace(tspec, micro_batch=global_batch // layout["fsdp"], device="cpu").validate(),
        layout=Layout(**layout),
    )
    job = TrainJob(config, run_dir, progress=not args.no_progress)
    print(
        f"layout: {' × '.join(f'{a} {n}' for a, n in layout.items())} on {args.nproc} CPU ranks (gloo)",
        flush=True,
    )
    code = start(job, args.nproc)
    if code:
        return code
    ln_vocab = math.log(spec.vocab)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    held = next((r["held_out_loss"] for r in reversed(records) if "held_out_loss" in r), float("nan"))
    print(
        f"held-out loss {held:.3f} nats/token vs ln(vocab) = {ln_vocab:.3f}: "
        f"{1 - held / ln_vocab:.0%} below ({time.perf_counter() - started:.0f} s)"
    )
    _print_ledger(run_dir / "ledger.json")
    print(
        f"run directory: {run_dir}  (config.toml, metrics.jsonl, ledger.json, loss.png, trace.json, "
        "checkpoints/)"
    )
    return 0


def _print_ledger(path) -> None:
    """Rank 0's communication per training step (mean of the steady steps) by axis and collective."""
    if not path.exists():
        return
    rows = json.loads(path.read_text()).get("summary", [])
    print("communication per step on rank 0 (ledger.json):")
    print(f"  {'axis':<8} {'op':<15} {'count':>7} {'bytes':>14} {'wire bytes':>14}")
    for row in rows:
        print(
            f"  {row['axis']:<8} {row['op']:<15} {row['count']:>7.1f} {row['bytes']:>14,.0f} "
            f"{row['wire_bytes']:>14,.0f}"
        )
