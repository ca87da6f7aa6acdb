"""What the saved-activation meter costs a training step, and why `train` leaves it off by default.

One process trains the `small` preset (AdamW, fp32). Steps rotate between plain and metered (the
`ActivationMeter` hooks every tensor autograd saves), so machine noise hits both alike; the ratio of
the medians (and of the minima, the steadier figure on a shared machine) is the meter's overhead.
`fivefold train` runs it only with `--measure-memory-every N`; `verify` always does.
Run: .venv/bin/python benchmarks/bench_measure.py [--model small] [--seq-len 256] [--batch 8]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from fivefold.config import load_model
from fivefold.measure.memory import ActivationMeter
from fivefold.model.transformer import build_model, lm_loss, materialize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=8, help="timed steps per mode")
    args = parser.parse_args()

    torch.manual_seed(0)
    spec = load_model(args.model)
    model = materialize(build_model(spec), "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, spec.vocab, (args.batch, args.seq_len + 1))

    def step(metered: bool) -> float:
        t0 = time.perf_counter()
        with ActivationMeter() if metered else contextlib.nullcontext():
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    for metered in (False, True):  # warm-up
        step(metered)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for metered in (False, True):
            times[metered].append(step(metered))

    load = os.getloadavg()[0]
    plain, metered = times[False], times[True]
    print(
        f"model {args.model}, seq {args.seq_len}, batch {args.batch}, "
        f"{args.repeats} steps each, load average {load:.2f}"
    )
    print(f"{'':<8}{'median s':>10}{'min s':>10}")
    print(f"{'plain':<8}{statistics.median(plain):>10.4f}{min(plain):>10.4f}")
    print(f"{'metered':<8}{statistics.median(metered):>10.4f}{min(metered):>10.4f}")
    print(
        f"meter overhead: median ×{statistics.median(metered) / statistics.median(plain):.3f}, "
        f"min ×{min(metered) / min(plain):.3f}"
    )


if __name__ == "__main__":
    main()
