"""Pipeline schedules: idle time (the bubble) and micro-batches in flight on the busiest stage.

Notation: p stages, m micro-batches per step, v model chunks per rank; t_f, t_b the forward and
backward time of one micro-batch through a whole stage (all its chunks), t_w the weight-gradient
half of t_b (schedules that split the backward run it later to fill the bubble).
"""

from __future__ import annotations

import math

from fivefold.plan.runshape import RunShape, Traffic


def bubble_time(schedule: str, p: int, m: int, v: int, t_f: float, t_b: float) -> float:
    """Idle time per step on a stage, in the same unit as t_f and t_b."""
    if p <= 1:
        return 0.0
    t_w = t_b / 2  # weight gradient ≈ input gradient: both are one matmul per forward matmul
    if m < p:  # too few micro-batches to reach a steady state: every schedule degrades to fill and drain
        return (p - 1) * (t_f + t_b)
    if schedule in ("gpipe", "1f1b"):
        # GPipe (Huang et al. 2019), 1F1B (Narayanan et al. 2019): fill and drain, (p-1)(t_f+t_b)
        return (p - 1) * (t_f + t_b)
    if schedule == "interleaved-1f1b":
        # Narayanan et al. 2021 §2.2.2: each chunk is 1/v of the stage, so the bubble shrinks by v
        return (p - 1) * (t_f + t_b) / v
    if schedule == "zero-bubble":
        # ZB-H1 (Qi et al. 2024): weight gradients fill the drain, (p-1)(t_f + t_b_input - t_w);
        # torch's interleaved zero-bubble runs v chunks of 1/v of the stage, shrinking it by v
        # (checked against the schedule's own action table in parallel/bubble.py)
        return (p - 1) * max(t_f + (t_b - t_w) - t_w, 0.0) / v
    if schedule == "zbv":
        # ZB-V: two chunks in a V shape; (p-1)(t_f + t_b_input - 2 t_w) per half-size chunk
        return (p - 1) * max(t_f + (t_b - t_w) - 2 * t_w, 0.0) / 2
    if schedule == "dualpipev":
        # DeepSeek-V3 Table 2: (p/2 - 1)(t_FB + t_B - 3 t_W) per chunk, two chunks per rank
        t_fb = (t_f + t_b) / 2
        return max(p / 2 - 1, 0.0) * max(t_fb + (t_b / 2) - 3 * (t_w / 2), 0.0)
    raise ValueError(schedule)


def bubble_fraction(schedule: str, p: int, m: int, v: int, t_f: float = 1.0, t_b: float = 2.0) -> float:
    """Idle share of the pipeline's wall time: bubble / (bubble + m·(t_f+t_b)); (p-1)/(m+p-1) for 1F1B."""
    idle = bubble_time(schedule, p, m, v, t_f, t_b)
    return idle / (idle + m * (t_f + t_b))


def min_microbatches(p: int, max_bubble: float) -> int:
    """Fewest micro-batches with (p-1)/(m+p-1) ≤ max_bubble: m ≥ (p-1)(1-ε)/ε (1F1B, GPipe)."""
    if p <= 1:
        return 1
    m = math.ceil((p - 1) * (1 - max_bubble) / max_bubble - 1e-9)
    return max(m, 1)


def in_flight(schedule: str, p: int, m: int, v: int, rank: int = 0) -> float:
    """Micro-batches of whole-stage activations pp rank `rank` holds at its peak."""
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)  # all forwards before any backward
    if schedule == "interleaved-1f1b":
        # Megatron's warm-up: (p - rank - 1)·2 + (v - 1)·p chunk forwards before the first backward,
        # each chunk 1/v of the stage; rank 0 holds p·(1 + (p-1)/(p·v)) (Korthikanti et al. §4.2.3)
        return min(((p - rank - 1) * 2 + (v - 1) * p + 1) / v, float(m))
    if schedule == "dualpipev":
        # torch's DualPipeV table: p + ½ stages' worth on every rank (DeepSeek-V3's Table 2 gives
        # PP+1 micro-batches for the two-way DualPipe, whose ranks hold both directions' chunks)
        return min(p + 0.5, float(m))
    if schedule == "zbv":
        # the V balances memory: every rank holds 1F1B's first-stage peak, p, once m ≥ 2p - rank - 1;
        # with fewer micro-batches, the m + rank + 1 chunk forwards of its warm-up (torch's table)
        return min(float(p), (m + rank + 1) / 2)
    if schedule == "zero-bubble":
        # torch's schedule defers the weight passes into the cool-down: every rank holds p (its action
        # table, which `plan.activations.schedule_peak` replays), where 1F1B's last rank holds one
        return float(min(p, m))
    return float(min(p - rank, m))  # 1F1B: p - rank warm-up forwards


def p2p_on_critical_path(schedule: str, p: int, v: int) -> int:
    """Stage-to-stage transfers that nothing hides: the fill and the drain."""
    if p <= 1:
        return 0
    return 2 * (p - 1) * (v if schedule == "interleaved-1f1b" else 1)


def pipeline_traffic(run: RunShape, pp_rank: int) -> Traffic:
    """Stage-to-stage traffic of one step on one pp rank, and the loss hand-back.

    Every boundary between chunks on different ranks carries each micro-batch's activation
    [b, s/(tp with SP), h] forward and its gradient backward: this rank sends and receives one
    tensor per micro-batch per boundary it touches. The mean loss is broadcast from the last
    stage over pp (fp32).
    """
    from fivefold.layout_math import BROADCAST, RECV, SEND, stage_to_rank

    lay = run.layout
    out = Traffic()
    if lay.pp == 1:
        return out
    tokens = run.tokens // (lay.tp if lay.sp else 1)
    act = tokens * run.spec.hidden * run.stream_bytes
    chunks = lay.pp * lay.virtual_stages
    touched = 0
    for s in range(chunks - 1):
        here, there = stage_to_rank(s, lay.pp, lay.pp_schedule), stage_to_rank(s + 1, lay.pp, lay.pp_schedule)
        if here != there and pp_rank in (here, there):
            touched += 1
    out.add("pp", SEND, run.microbatches * touched, act)
    out.add("pp", RECV, run.microbatches * touched, act)
    out.add("pp", BROADCAST, 1, 4)
    return out
