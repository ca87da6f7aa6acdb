"""Chrome / Perfetto trace events of each step's phases, one process row per rank.

The loop records `forward_backward`, `optimizer` and `eval` spans; a runner that accepts a
`tracer` (the pipeline runner does, for per-micro-batch events) adds its own spans on the same
clock. Each rank writes `trace.rank<R>.json`; rank 0 merges them into `trace.json`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fivefold.outputs import write_text_whole

LOOP_TID = 2  # the pipeline timeline uses threads 0 and 1 of the same rank's row


class Tracer:
    """Collects complete ("X") events; timestamps in microseconds since the epoch."""

    def __init__(self, rank: int = 0, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self.events: list[dict[str, Any]] = []

    @contextmanager
    def span(self, name: str, cat: str = "compute", **args: Any) -> Iterator[None]:
        """Record the time spent inside the block as one event."""
        if not self.enabled:
            yield
            return
        start = time.time_ns() // 1000
        try:
            yield
        finally:
            self.add(name, start, time.time_ns() // 1000 - start, cat, **args)

    def add(self, name: str, start_us: int, dur_us: int, cat: str = "compute", **args: Any) -> None:
        """Record an event measured elsewhere (e.g. from a schedule's own timers)."""
        if self.enabled:
            self.events.append(
                {
                    "name": name,
                    "cat": cat,
                    "ph": "X",
                    "ts": start_us,
                    "dur": dur_us,
                    "pid": self.rank,
                    "tid": LOOP_TID,
                    "args": args,
                }
            )

    def write_part(self, run_dir: Path) -> Path:
        path = run_dir / f"trace.rank{self.rank}.json"
        meta = {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}
        path.write_text(json.dumps([meta] + self.events))
        return path


def merge_trace_parts(run_dir: Path, world: int) -> Path:
    """Merge every rank's part into `trace.json` (Chrome's JSON object format) and drop the parts."""
    events: list[dict[str, Any]] = []
    for rank in range(world):
        part = run_dir / f"trace.rank{rank}.json"
        if part.exists():
            events += json.loads(part.read_text())
            os.remove(part)
    out = run_dir / "trace.json"
    write_text_whole(out, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), "output")
    return out


@contextmanager
def torch_profile(run_dir: Path, rank: int, device_type: str, enabled: bool) -> Iterator[None]:
    """Record the block with torch.profiler when `enabled` (`--profile-step N`).

    Writes run_dir/profile/rank<R>.json, a Chrome/Perfetto trace of every op and collective, and
    rank<R>.txt, the ops sorted by their own time, so one look says where the step went.
    """
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    prof.export_chrome_trace(str(out / f"rank{rank}.json"))
    sort = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages(group_by_input_shape=True)
    table = averages.table(sort_by=sort, row_limit=60, max_name_column_width=60)
    (out / f"rank{rank}.txt").write_text(table + "\n")
