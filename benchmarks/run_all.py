"""Run every benchmark in this folder, one after another, and print each one's table.

Benchmarks are comparisons against a peer measured in the same run (ratios, medians), not timed
tests; `make bench` calls this. Pass names to run only some: `python benchmarks/run_all.py ledger plan`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    if argv:
        scripts = [s for s in scripts if any(name in s.stem for name in argv)]
        if not scripts:
            print(
                f"no benchmark matches {' '.join(argv)}; have: "
                f"{', '.join(s.stem for s in sorted(HERE.glob('bench_*.py')))}",
                file=sys.stderr,
            )
            return 2
    failed = []
    for script in scripts:
        print(f"\n=== {script.stem} ===", flush=True)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, str(script)])
        print(f"--- {script.stem}: {time.perf_counter() - start:.0f} s, exit {done.returncode}", flush=True)
        if done.returncode:
            failed.append(script.stem)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
