"""Pipeline pictures from the schedule's own per-rank action table.

`measure.bubble` instantiates torch's schedule class for (schedule, p, m, V) and replays its
action table; the picture is that replay, so every schedule is drawn as it runs (interleaved
chunks, zero-bubble's split backward, the V shapes) and the idle share printed beside it is the
one of the drawing. Costs are bubble.py's `1:2` model: t_B = 2·t_F, split as I = W = t_F.
Small replays are embedded op by op; every replay also as a raster of COLUMNS cells per rank
(run-length coded), which is what the page draws for big ones.
"""

from __future__ import annotations

from typing import Any

COLUMNS = 600
MAX_OPS_EXACT = 2500  # above this many actions the page gets the raster only
COST_MODEL = "1:2"
# torch's action tables grow faster than linearly in m (an interleaved p=4 step: 0.2 s at m=256, 33 s
# at 4096); past this many micro-batches a step is drawn with this many, and the page says so
MAX_DRAWN_MICROBATCHES = 256


def drawn_microbatches(pp: int, microbatches: int) -> int:
    """The micro-batches a picture replays: all of them, or MAX_DRAWN_MICROBATCHES (at least 2·pp, as
    V schedules need) rounded down to a multiple of pp where m was one (interleaved schedules need it)."""
    cap = max(MAX_DRAWN_MICROBATCHES, 2 * pp)
    if microbatches <= cap:
        return microbatches
    return cap - cap % pp if microbatches % pp == 0 else cap


def pipeline_picture(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> dict[str, Any]:
    """The replayed timeline of one step: per rank its ops (or raster) and the idle share."""
    from fivefold.measure.bubble import simulated_bubble  # imports torch's schedules: only when drawn

    drawn = drawn_microbatches(pp, microbatches)
    try:
        sim = simulated_bubble(schedule, pp, drawn, virtual_stages, COST_MODEL)
    except ValueError as exc:  # torch refuses the table (e.g. V schedules want m >= 2p): say so
        return {"schedule": schedule, "p": pp, "m": microbatches, "error": str(exc)}
    total = sum(len(row) for row in sim.timeline)
    makespan = sim.makespan
    picture: dict[str, Any] = {
        "schedule": schedule,
        "p": pp,
        "m": drawn,
        "m_step": microbatches,  # the step's own count, where only the first `m` are drawn
        "v": 2 if schedule in ("zbv", "dualpipev") else virtual_stages,
        "makespan": makespan,
        "idle": sim.idle_fraction,
        "cost_model": "t_B = 2·t_F (split backward: I = W = t_F)",
    }
    if total <= MAX_OPS_EXACT:
        picture["ops"] = [
            [[round(s, 6), round(e - s, 6), kind, stage, mb] for s, e, (stage, kind, mb) in row]
            for row in sim.timeline
        ]
    picture["raster"] = [_raster(row, makespan) for row in sim.timeline]
    return picture


def _raster(row: list[tuple[float, float, tuple[int, str, int]]], makespan: float) -> str:
    """COLUMNS cells: the op kind covering most of each cell, '.' where the rank is mostly idle."""
    width = makespan / COLUMNS
    cover: list[dict[str, float]] = [{} for _ in range(COLUMNS)]
    for start, end, (_, kind, _) in row:
        first, last = int(start / width), min(int(end / width), COLUMNS - 1)
        for c in range(first, last + 1):
            overlap = min(end, (c + 1) * width) - max(start, c * width)
            if overlap > 0:
                cover[c][kind] = cover[c].get(kind, 0.0) + overlap
    cells = []
    for c in cover:
        busy = sum(c.values())
        cells.append(max(c, key=c.get) if busy > width / 2 else ".")
    return run_length("".join(cells))


def run_length(cells: str) -> str:
    """'FFFB..' -> 'F3B1.2': the raster is long runs of one kind."""
    out, i = [], 0
    while i < len(cells):
        j = i
        while j < len(cells) and cells[j] == cells[i]:
            j += 1
        out.append(f"{cells[i]}{j - i}")
        i = j
    return "".join(out)


def expand(runs: str) -> str:
    """The inverse of `run_length`."""
    import re

    return "".join(kind * int(n) for kind, n in re.findall(r"([^0-9])([0-9]+)", runs))
