"""The measured pipeline timeline: when each rank ran which forward, backward, weight-gradient,
send/recv wait, and when it sat idle, per micro-batch.

`Timeline.instrument(stage)` wraps one `PipelineStage`'s compute calls (instance attributes, the class
is untouched); `Timeline.step()` brackets one optimizer step and, for its duration, wraps the two
helpers every torch schedule posts and waits its point-to-point work through, so a wait on a receive is
recorded with its peer and bytes. Gaps inside a step that no event covers become `idle` events.

Events are Chrome-trace ("X") dicts, `pid` = global rank, `ts`/`dur` in microseconds of wall time
(shared by processes on one machine; across machines, as good as their clocks), category `pipeline`.
`write_trace` gathers them to rank 0 and merges them into the run's `trace.json`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fivefold.outputs import write_text_whole

CATEGORY = "pipeline"
COMPUTE_KINDS = ("F", "B", "I", "W")  # forward, full backward, input-grad backward, weight-grad backward
KINDS = COMPUTE_KINDS + ("send", "recv", "send/recv", "idle")


def _now_us() -> float:
    return time.time_ns() / 1000.0


class Timeline:
    """Per-rank recorder; keeps the last `keep_steps` steps."""

    def __init__(self, rank: int, pp_rank: int, keep_steps: int = 4) -> None:
        self.rank = rank
        self.pp_rank = pp_rank
        self.keep_steps = keep_steps
        self.steps: list[list[dict[str, Any]]] = []
        self._current: list[dict[str, Any]] | None = None
        self._step_index = 0  # the optimizer step being recorded, numbered from 1 as train numbers them
        self._work_info: dict[int, tuple[str, int, list[int]]] = {}

    def resume_after(self, step: int) -> None:
        """A run resumed from the checkpoint of `step`: the next step recorded is step + 1."""
        self._step_index = step

    # ---- recording
    def _record(self, kind: str, start: float, end: float, **args: Any) -> None:
        if self._current is None:
            return
        name = kind if args.get("mb") is None else f"{kind}{args['mb']}"
        if "stage" in args and args["stage"] is not None and kind in COMPUTE_KINDS:
            name = f"{args['stage']}{name}"
        self._current.append(
            {
                "name": name,
                "cat": CATEGORY,
                "ph": "X",
                "ts": start,
                "dur": max(end - start, 0.0),
                "pid": self.rank,
                "tid": 0,
                "args": {"kind": kind, "step": self._step_index, "pp_rank": self.pp_rank, **args},
            }
        )

    def instrument(self, stage: Any) -> None:
        """Wrap this stage's forward, backward and weight-gradient calls."""
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        weight = stage.backward_weight_one_chunk
        index = stage.stage_index

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            t0 = _now_us()
            out = forward(fwd_chunk_id, *args, **kwargs)
            self._record("F", t0, _now_us(), stage=index, mb=fwd_chunk_id)
            return out

        def backward_one_chunk(
            bwd_chunk_id: int, *args: Any, full_backward: bool = True, **kwargs: Any
        ) -> Any:
            t0 = _now_us()
            out = backward(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)
            self._record("B" if full_backward else "I", t0, _now_us(), stage=index, mb=bwd_chunk_id)
            return out

        def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            t0 = _now_us()
            out = weight(bwd_chunk_id, *args, **kwargs)
            self._record("W", t0, _now_us(), stage=index, mb=bwd_chunk_id)
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Record one optimizer step; point-to-point waits are timed while inside."""
        from fivefold import torch_internals  # torch, only where a pipeline step runs

        self._step_index += 1
        self._current = []
        info = self._work_info

        def batch_p2p(post: Callable, p2p_ops: list, desc: str | None) -> list:
            works = post(p2p_ops, desc)
            ops = {op.op.__name__ for op in p2p_ops}
            kind = "send" if ops == {"isend"} else "recv" if ops == {"irecv"} else "send/recv"
            nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in p2p_ops)
            peers = sorted({op.peer for op in p2p_ops})
            for w in works:
                info[id(w)] = (kind, nbytes, peers)
            return works

        def wait_batch_p2p(wait: Callable, works: list) -> None:
            t0 = _now_us()
            wait(works)
            for w in works:
                kind, nbytes, peers = info.pop(id(w), ("send/recv", 0, []))
                self._record(kind, t0, _now_us(), bytes=nbytes, peers=peers)
                t0 = _now_us()

        start = _now_us()
        try:
            with torch_internals.pipeline_p2p(batch_p2p, wait_batch_p2p):
                yield
        finally:
            end = _now_us()
            events = self._current
            self._current = None
            info.clear()
            events.extend(_idle_gaps(events, start, end, self.rank, self._step_index, self.pp_rank))
            events.append(
                {
                    "name": "step",
                    "cat": CATEGORY,
                    "ph": "X",
                    "ts": start,
                    "dur": end - start,
                    "pid": self.rank,
                    "tid": 1,
                    "args": {"kind": "step", "step": self._step_index, "pp_rank": self.pp_rank},
                }
            )
            self.steps.append(events)
            del self.steps[: -self.keep_steps]

    def events(self) -> list[dict[str, Any]]:
        return [e for step in self.steps for e in step]


def _idle_gaps(
    events: list[dict[str, Any]], start: float, end: float, rank: int, step: int, pp_rank: int
) -> list[dict[str, Any]]:
    """Intervals of [start, end] that no compute event covers (waits on peers count as idle)."""
    busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["args"]["kind"] in COMPUTE_KINDS)
    gaps, cursor = [], start
    for s, e in busy:
        if s > cursor:
            gaps.append((cursor, s))
        cursor = max(cursor, e)
    if end > cursor:
        gaps.append((cursor, end))
    return [
        {
            "name": "idle",
            "cat": CATEGORY,
            "ph": "X",
            "ts": s,
            "dur": e - s,
            "pid": rank,
            "tid": 0,
            "args": {"kind": "idle", "step": step, "pp_rank": pp_rank},
        }
        for s, e in gaps
        if e > s
    ]


def idle_fraction(events: list[dict[str, Any]], step: int | None = None) -> float:
    """Measured bubble: idle time / (ranks × step wall time), over one step (default: the last)."""
    steps = [e for e in events if e["args"].get("kind") == "step"]
    if not steps:
        return 0.0
    step = max(e["args"]["step"] for e in steps) if step is None else step
    chosen = [e for e in events if e["args"].get("step") == step]
    windows = [e for e in chosen if e["args"]["kind"] == "step"]
    t0 = min(e["ts"] for e in windows)
    t1 = max(e["ts"] + e["dur"] for e in windows)
    ranks = sorted({e["pid"] for e in windows})
    busy = sum(e["dur"] for e in chosen if e["args"]["kind"] in COMPUTE_KINDS)
    return 1.0 - busy / (len(ranks) * (t1 - t0)) if t1 > t0 else 0.0


def gather_events(timeline: Timeline | None) -> list[dict[str, Any]] | None:
    """All ranks' events on global rank 0 (None elsewhere); every rank must call it."""
    import torch.distributed as dist

    mine = timeline.events() if timeline is not None else []
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everything: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everything, dst=0)
    if everything is None:
        return None
    return [e for rank_events in everything for e in (rank_events or [])]


def merge_into_trace(path: str | Path, events: list[dict[str, Any]]) -> None:
    """Add `events` to a Chrome trace file, replacing earlier pipeline events; create it if missing."""
    p = Path(path)
    trace: dict[str, Any] = {"traceEvents": []}
    if p.exists():
        try:
            loaded = json.loads(p.read_text())
            trace = loaded if isinstance(loaded, dict) else {"traceEvents": loaded}
        except json.JSONDecodeError:
            pass
    kept = [e for e in trace.get("traceEvents", []) if e.get("cat") != CATEGORY]
    names = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}}
        for pid in sorted({e["pid"] for e in events})
    ]
    have_names = {(e.get("pid"), e.get("name")) for e in kept if e.get("ph") == "M"}
    kept += [n for n in names if (n["pid"], n["name"]) not in have_names]
    trace["traceEvents"] = kept + events
    trace.setdefault("displayTimeUnit", "ms")
    write_text_whole(p, json.dumps(trace), "output")


def write_trace(path: str | Path, timeline: Timeline | None) -> None:
    """Collective: gather every rank's pipeline events and merge them into `path` on rank 0."""
    events = gather_events(timeline)
    if events is not None:
        merge_into_trace(path, events)


def load_pipeline_events(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    data = json.loads(p.read_text())
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(events, list):  # the file is read back from a run directory: anything may be there
        raise ValueError("expected a list of trace events")
    return [e for e in events if isinstance(e, dict) and e.get("cat") == CATEGORY and e.get("ph") == "X"]
