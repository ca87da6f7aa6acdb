"""`fivefold demo`: the default job — train the `small` model on the embedded corpus.

The corpus is the running interpreter's standard library (no download); the tokenizer is
byte-level, so the loss starts near ln(256) = 5.55 nats and a working set-up ends far below it.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

from fivefold.config import RunConfig, TrainSpec, load_model

HELP = "set-up check: train the default model on the embedded corpus"
DEMO_MODEL = "small"
# 200 steps of 8×128 bytes take about 0.15 CPU-seconds each and end near 2 nats held-out (~60% below
# ln 256); the loss is under the 3.33 bar from about step 30 on.
DEMO_TRAIN = TrainSpec(steps=200, eval_every=50)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", default=None, help="run directory (default runs/demo-<time>)")
    parser.add_argument(
        "--steps", type=int, default=None, help=f"optimizer steps (default {DEMO_TRAIN.steps})"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    import torch

    from fivefold.commands.train import default_run_dir
    from fivefold.train.loop import train

    started = time.perf_counter()
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
    print(
        f"training {spec.name} ({spec.num_params() / 1e6:.2f} M parameters) for {tspec.steps} steps "
        f"on the Python standard library's sources, byte-level; run directory: {run_dir}",
        flush=True,
    )
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
