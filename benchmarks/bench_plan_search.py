"""Layout search time for Llama-3 405B on 16,384 H100s, against exhaustive scoring of the same layouts.

The peer is the planner itself without branch and bound (every fitting layout fully planned), so the
ratio shows what the pruning buys; both must return the same best layout.
Run: .venv/bin/python benchmarks/bench_plan_search.py
"""

from __future__ import annotations

import statistics
import time

import fivefold.plan.search as search_mod
from fivefold.config import load_hardware, load_model
from fivefold.plan import TrainShape


def timed(fn, repeat: int) -> tuple[float, object]:
    """Median CPU time of this process (`time.process_time`): other load on the machine does not count."""
    times, out = [], None
    for _ in range(repeat):
        start = time.process_time()
        out = fn()
        times.append(time.process_time() - start)
    return statistics.median(times), out


def main() -> None:
    model, hw = load_model("llama3-405b"), load_hardware("h100-80gb")
    shape = TrainShape(seq_len=8192, global_batch=2048)
    cold, result = timed(lambda: search_mod.search(model, hw, 16384, shape), 1)
    warm, result = timed(lambda: search_mod.search(model, hw, 16384, shape), 3)
    print(
        f"search llama3-405b on 16384 x h100-80gb: {result.considered} layouts considered, "
        f"{result.fitting} fit; CPU time: first run {cold:.2f} s, median of 3 warm runs {warm:.2f} s"
    )
    pinned_time, pinned = timed(
        lambda: search_mod.search(model, hw, 16384, shape, pins={"tp": 8, "pp": 16}), 3
    )
    print(f"pinned --tp 8 --pp 16: {pinned.considered} layouts considered, CPU time {pinned_time:.2f} s")
    exhaustive_time, exhaustive = timed(lambda: search_mod.search(model, hw, 16384, shape, top=10**9), 1)
    same = exhaustive.plans[0].layout == result.plans[0].layout
    print(
        f"exhaustive scoring of all {len(exhaustive.plans)} fitting layouts: {exhaustive_time:.2f} s "
        f"(ratio {exhaustive_time / warm:.1f}x), same best layout: {same}"
    )
    print("\n".join(result.explanation))


if __name__ == "__main__":
    main()
