"""The pipeline bubble, computed from a schedule's own per-rank action table.

torch's schedules build `pipeline_order`: for each pp rank, the ordered list of compute actions it
will run (forward F, full backward B, input-gradient backward I, weight-gradient backward W, and
DualPipeV's overlapped F+B pairs), with None as spacing. `simulate` replays such a table with given op
costs: each rank runs its actions in order, each action starting when the rank is free and its
inputs exist —

    F(s, j) after F(s-1, j);   B/I(s, j) after F(s, j) and B/I(s+1, j);   W(s, j) after I(s, j)

— with free communication. The idle fraction, 1 − busy / (ranks × makespan), is then set against the
closed forms of the papers (`closed_form`). Costs are per whole stage: a chunk of an interleaved
schedule costs 1/V of it. Two cost models: `unit` (t_F = t_B = 1, the backward split I = W = ½) and
`1:2` (t_F = 1, t_B = 2 with I = W = 1, the usual matmul count and the zero-bubble paper's setting).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from fivefold.parallel.pipeline import SCHEDULE_CLASSES, V_SHAPED, stage_to_rank

COST_MODELS: dict[str, dict[str, float]] = {
    "unit": {"F": 1.0, "B": 1.0, "I": 0.5, "W": 0.5},
    "1:2": {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0},
}

Op = tuple[int, str, int]  # (stage, kind F/B/I/W, micro-batch)


@dataclass
class Simulation:
    makespan: float
    busy: list[float]  # per rank
    timeline: list[list[tuple[float, float, Op]]]  # per rank: (start, end, op)
    repaired: bool  # the table's micro-batch numbering had to be rebuilt (see `action_table`)

    @property
    def idle_fraction(self) -> float:
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def action_table(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 1
) -> tuple[list[list[Op]], bool]:
    """The compute actions per pp rank, in order, as torch's schedule class builds them.

    Returns (table, repaired). torch's 1F1B table numbers the last rank's micro-batches from 1 (its
    runtime loop does not use the table); where a stage's F, B, I or W indices are not exactly
    0..m-1, they are renumbered in order of appearance — every schedule here runs a stage's
    micro-batches in increasing order — and `repaired` is True.
    """
    raw = _pipeline_order(schedule, pp, microbatches, virtual_stages)
    table: list[list[Op]] = []
    for rank in range(pp):
        actions = raw[rank]
        ops: list[Op] = []
        for action in actions:
            if action is None:
                continue
            for a in action.sub_actions or (action,):  # DualPipeV's overlapped pairs run one after the other
                kind = a.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    ops.append((a.stage_index, kind, a.microbatch_index))
        table.append(ops)
    return _renumber_if_needed(table, microbatches)


class _StandInStage:
    """What a schedule's constructor reads from its stages: enough to build the action table."""

    def __init__(self, pp: int, chunks: int) -> None:
        self.group_rank, self.group_size, self.submod, self.num_stages = 0, pp, None, chunks
        self.stage_index_to_group_rank: dict[int, int] = {}


@lru_cache(maxsize=256)
def _pipeline_order(schedule: str, pp: int, m: int, v: int) -> dict:
    """Instantiate the torch schedule on stand-in stages (no process group) for its action table."""
    from torch.distributed import pipelining

    stage = _StandInStage(pp, pp * v)
    cls = getattr(pipelining, SCHEDULE_CLASSES[schedule])
    target = stage if schedule in ("gpipe", "1f1b") else [stage] * v
    return cls(target, m).pipeline_order


def _renumber_if_needed(table: list[list[Op]], m: int) -> tuple[list[list[Op]], bool]:
    """Check each stage runs F on 0..m-1, a backward (B or I) on 0..m-1 and W for exactly its I's;
    otherwise renumber by order of appearance (B and I share one count, W follows its I's)."""

    def group(kind: str) -> str:
        return "BI" if kind in ("B", "I") else kind

    seen: dict[tuple[int, str], list[int]] = {}
    for ops in table:
        for s, k, j in ops:
            seen.setdefault((s, group(k)), []).append(j)
    inputs_of = {s: sorted(j for ops in table for (t, k, j) in ops if t == s and k == "I") for s, _ in seen}
    valid = all(sorted(v) == (inputs_of[s] if g == "W" else list(range(m))) for (s, g), v in seen.items())
    if valid:
        return table, False
    counters: dict[tuple[int, str], int] = {}
    input_order: dict[int, list[int]] = {}
    fixed = []
    for ops in table:
        row = []
        for s, k, _ in ops:
            if k == "W":
                j = input_order[s][counters.get((s, "W"), 0)]
                counters[(s, "W")] = counters.get((s, "W"), 0) + 1
            else:
                j = counters.get((s, group(k)), 0)
                counters[(s, group(k))] = j + 1
                if k == "I":
                    input_order.setdefault(s, []).append(j)
            row.append((s, k, j))
        fixed.append(row)
    return fixed, True


def simulate(
    table: list[list[Op]],
    num_stages: int,
    costs: dict[str, float],
    virtual_stages: int = 1,
    repaired: bool = False,
) -> Simulation:
    """Replay the table: list scheduling in each rank's order, inputs permitting."""
    scale = 1.0 / virtual_stages
    done: dict[tuple[int, str, int], float] = {}  # (stage, kind, mb) -> end time
    clock = [0.0] * len(table)
    busy = [0.0] * len(table)
    pointer = [0] * len(table)
    timeline: list[list[tuple[float, float, Op]]] = [[] for _ in table]
    remaining = sum(len(ops) for ops in table)
    while remaining:
        progressed = False
        for r, ops in enumerate(table):
            while pointer[r] < len(ops):
                op = ops[pointer[r]]
                ready = _ready_time(op, done, num_stages)
                if ready is None:
                    break
                start = max(clock[r], ready)
                end = start + costs[op[1]] * scale
                done[op] = end
                if op[1] in ("B", "I"):
                    done[(op[0], "grad_in", op[2])] = end
                clock[r], busy[r] = end, busy[r] + end - start
                timeline[r].append((start, end, op))
                pointer[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: ops[pointer[r]] for r, ops in enumerate(table) if pointer[r] < len(ops)}
            raise ValueError(f"schedule deadlocks: next actions {stuck} wait on inputs never produced")
    return Simulation(max(clock), busy, timeline, repaired)


def _ready_time(op: Op, done: dict, num_stages: int) -> float | None:
    stage, kind, mb = op
    deps: list[tuple[int, str, int]] = []
    if kind == "F":
        if stage > 0:
            deps.append((stage - 1, "F", mb))
    elif kind in ("B", "I"):
        deps.append((stage, "F", mb))
        if stage < num_stages - 1:
            deps.append((stage + 1, "grad_in", mb))
    elif kind == "W":
        deps.append((stage, "I", mb))
    times = [done.get(d) for d in deps]
    if any(t is None for t in times):
        return None
    return max(times, default=0.0)


def simulated_bubble(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 1, cost_model: str = "unit"
) -> Simulation:
    v = 2 if schedule in V_SHAPED else virtual_stages
    table, repaired = action_table(schedule, pp, microbatches, v)
    return simulate(table, pp * v, COST_MODELS[cost_model], v, repaired)


def closed_form(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 1, cost_model: str = "unit"
) -> float:
    """The idle fraction the analysis predicts: bubble / (bubble + m·(t_F + t_B)) per rank.

    * GPipe (Huang et al. 2019), 1F1B (Narayanan et al. 2019): bubble (p−1)(t_F + t_B), i.e.
      (p−1)/(m+p−1) whatever the F:B ratio.
    * Interleaved 1F1B (Narayanan et al. 2021) with V chunks: (p−1)(t_F + t_B)/V, i.e. (p−1)/(V·m+p−1).
    * Zero bubble ZB-H1 (Qi et al. 2024), with V chunks: (p−1)(t_F + t_I − t_W)/V — the weight
      gradients fill the drain.
    * ZB-V and DualPipeV, for one step: the fill of the V, (p−1)·t_F/2. The last rank cannot start
      before p−1 half-stage forwards, and every rank does the same work, so no single-step schedule
      does better; the papers' "zero bubble" (ZB-V when t_F = t_I = t_W) and DualPipe's
      (p−1)(t_F&B + t_B − 3t_W)/2 count the steady state, with the next step's fill overlapped by
      post-validation of the optimizer step or with F and B overlapped on two streams, which a
      single step on one CPU stream cannot do. See `published_form`.
    """
    c = COST_MODELS[cost_model]
    f, b, i, w = c["F"], c["B"], c["I"], c["W"]
    p, m, v = pp, microbatches, virtual_stages
    if p <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        bubble = (p - 1) * (f + b)
    elif schedule == "interleaved-1f1b":
        bubble = (p - 1) * (f + b) / v
    elif schedule == "zero-bubble":
        bubble = (p - 1) * max(f + i - w, 0.0) / v
    elif schedule in ("zbv", "dualpipev"):
        bubble = (p - 1) * f / 2
    else:
        raise ValueError(schedule)
    return bubble / (bubble + m * (f + b))


def published_form(schedule: str, pp: int, microbatches: int, cost_model: str = "unit") -> float:
    """The steady-state formulas as published for the V schedules (chunks of half a stage).

    ZB-V: (p−1)(t_F + t_I − 2·t_W)/2. DualPipeV (DualPipe repository's table, PP = 2p chunks):
    (PP/2 − 1)(t_F&B + t_B − 3·t_W)/2 with t_F&B = t_F + t_B on one stream.
    """
    c = COST_MODELS[cost_model]
    f, b, i, w = c["F"], c["B"], c["I"], c["W"]
    p, m = pp, microbatches
    if schedule == "zbv":
        bubble = (p - 1) * max(f + i - 2 * w, 0.0) / 2
    elif schedule == "dualpipev":
        bubble = (p - 1) * max((f + b) + b - 3 * w, 0.0) / 2
    else:
        return closed_form(schedule, pp, microbatches, 1, cost_model)
    return bubble / (bubble + m * (f + b))


def bubble_table(
    cases: list[tuple[str, int, int, int]],
    cost_models: tuple[str, ...] = ("unit", "1:2"),
) -> list[dict[str, object]]:
    """Rows of schedule × (p, m, V) -> simulated vs closed-form idle fraction per cost model."""
    rows = []
    for schedule, p, m, v in cases:
        row: dict[str, object] = {"schedule": schedule, "p": p, "m": m, "V": v}
        for model in cost_models:
            sim = simulated_bubble(schedule, p, m, v, model)
            row[f"table {model}"] = sim.idle_fraction
            row[f"closed {model}"] = closed_form(schedule, p, m, v, model)
            if schedule in V_SHAPED:
                row[f"published {model}"] = published_form(schedule, p, m, model)
            row["repaired"] = sim.repaired
        rows.append(row)
    return rows


def ascii_diagram(sim: Simulation, width: int = 100) -> str:
    """The classic picture in text: one row per rank, F/B/I/W letters, '.' idle."""
    scale = width / sim.makespan
    lines = []
    for r, events in enumerate(sim.timeline):
        row = ["."] * width
        for start, end, (_, kind, _) in events:
            first = int(round(start * scale))
            for x in range(first, min(max(int(round(end * scale)), first + 1), width)):
                row[x] = kind
        lines.append(f"rank {r}: " + "".join(row))
    return "\n".join(lines)


__all__ = [
    "COST_MODELS",
    "Simulation",
    "action_table",
    "ascii_diagram",
    "bubble_table",
    "closed_form",
    "simulate",
    "simulated_bubble",
    "stage_to_rank",
]
