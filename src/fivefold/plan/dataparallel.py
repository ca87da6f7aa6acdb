"""Data-parallel traffic of a step: gradients, and weights under ZeRO (see docs/planner.md).

DDP all-reduces gradients once a step behind the last micro-batch's backward; the sharded optimizer
(zero 1) reduce-scatters them and all-gathers the updated weights behind the next forward; FSDP
(zero 2, 3) gathers weights and reduce-scatters gradients every micro-batch behind that micro-batch's
compute; HSDP replicas all-reduce their shard once a step.
"""

from __future__ import annotations

from collections.abc import Callable

from fivefold.config import HardwareSpec, Layout
from fivefold.plan.comm import collective_time, worst_link
from fivefold.plan.memory import shard_group
from fivefold.plan.spec import TrainShape


def members_per_node(layout: Layout, axes: tuple[str, ...], gpus_per_node: int) -> int:
    """Ranks of one group over `axes` that share a node (each axis contributes up to node/stride)."""
    from fivefold.mesh import strides

    st = strides(layout)
    out = 1
    for a in axes:
        size = getattr(layout, a)
        if size > 1:
            out *= min(size, max(1, gpus_per_node // st[a]))
    return max(1, min(out, gpus_per_node))


def data_parallel_traffic(
    layout: Layout,
    shape: TrainShape,
    m: int,
    dense: float,
    experts: float,
    kinds: dict[str, str],
    add: Callable[..., float],
    t_f: float,
    t_b: float,
    hw: HardwareSpec,
) -> None:
    """Record gradient (and ZeRO weight) traffic through `add`, each with the part no compute hides."""
    overlap = shape.overlap_grad_reduce
    g, p = shape.grad_bytes, shape.param_bytes
    z = layout.zero
    n = shard_group(layout)
    ep = layout.ep
    sharded_axes = ("fsdp", "cp") if layout.fsdp > 1 else ("dp", "cp")
    shard_link = worst_link(kinds, *sharded_axes)
    shard_axis = "fsdp" if layout.fsdp > 1 else "dp"
    per_node = members_per_node(layout, sharded_axes, hw.gpus_per_node) if shard_link == "mixed" else 1

    def once(axis: str, op: str, payload: float, group: int, link: str, window: float) -> None:
        if group <= 1 or payload <= 0:
            return
        k = per_node if link == shard_link else 1
        t = collective_time(hw, op, payload, group, link, k)[1]
        hidden = window if overlap else 0.0
        add(
            axis,
            op,
            payload,
            group,
            link,
            1,
            exposed=max(t - hidden, 0.0),
            overlap="last backward" if overlap else "none",
            per_node=k,
        )

    n_exp = max(n // ep, 1)
    if z <= 1:
        for payload, group, link in ((dense, n, shard_link), (experts, n_exp, shard_link)):
            if z == 0:
                once(shard_axis, "all-reduce", g * payload, group, link, t_b)
            else:
                once(shard_axis, "reduce-scatter", g * payload, group, link, t_b)
                once(shard_axis, "all-gather", p * payload, group, link, t_f)
    else:  # FSDP: gathers hide behind the micro-batch's forward, backward gathers and reduce-scatters
        # behind its backward (prefetching one layer ahead)
        bwd_gathers = 1 if z == 3 else 0
        shards = [(pl, grp) for pl, grp in ((dense, n), (experts, n_exp)) if grp > 1 and pl > 0]
        t_ag = {
            grp: collective_time(hw, "all-gather", p * pl, grp, shard_link, per_node)[1] for pl, grp in shards
        }
        t_rs = {
            grp: collective_time(hw, "reduce-scatter", g * pl, grp, shard_link, per_node)[1]
            for pl, grp in shards
        }
        busy_f = sum(t_ag.values())
        busy_b = bwd_gathers * busy_f + sum(t_rs.values())
        exposed_f = max(busy_f - t_f, 0.0)
        exposed_b = max(busy_b - t_b, 0.0)
        for payload, group in shards:
            ag_exposed = t_ag[group] / busy_f * exposed_f + bwd_gathers * t_ag[group] / busy_b * exposed_b
            add(
                shard_axis,
                "all-gather",
                p * payload,
                group,
                shard_link,
                (1 + bwd_gathers) * m,
                exposed=ag_exposed * m,
                overlap="micro-batch compute",
                per_node=per_node,
            )
            add(
                shard_axis,
                "reduce-scatter",
                g * payload,
                group,
                shard_link,
                m,
                exposed=t_rs[group] / busy_b * exposed_b * m,
                overlap="micro-batch backward",
                per_node=per_node,
            )
        if layout.dp > 1 and layout.fsdp > 1:  # HSDP: replicas all-reduce their shard once a step
            once(
                "dp",
                "all-reduce",
                g * (dense / n + experts / n_exp),
                layout.dp,
                kinds.get("dp", "inter"),
                t_b,
            )
