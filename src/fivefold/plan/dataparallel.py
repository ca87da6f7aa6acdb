"""Data-parallel traffic of a step: gradients, and weights under ZeRO (see docs/planner.md).

DDP all-reduces gradients once a step behind the last micro-batch's backward; the sharded optimizer
(zero 1) reduce-scatters them and all-gathers the updated weights behind the next forward; FSDP
(zero 2, 3) gathers weights and reduce-scatters gradients every micro-batch behind that micro-batch's
compute (once a step inside a pipeline, whose stage defers the sync to its last backward); HSDP
replicas all-reduce their shard as often. The overlapped part still slows the compute beside it
(`OVERLAP_DRAG`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fivefold.config import HardwareSpec, Layout
from fivefold.layout_math import (
    ALL_GATHER,
    ALL_REDUCE,
    BROADCAST,
    REDUCE_SCATTER,
    chunk_param_shapes,
    is_expert,
    names_by_layer,
    numel,
    one_world_group,
    padded,
    param_shapes,
    replica_axis,
    tp_local_shape,
)
from fivefold.plan.comm import collective_time, ring_nics, worst_link
from fivefold.plan.memory import MASTER_BYTES, expert_pad, shard_group
from fivefold.plan.runshape import Chunk, RunShape, Traffic, fsdp_sync_deferred
from fivefold.plan.spec import TrainShape

GRAD_BYTES = 4  # fp32 gradients and master weights, whatever the compute dtype
# Overlapped is not free: while a gradient or weight collective runs beside compute, NCCL's kernels
# hold SMs (its channels take 16-32 of an H100's 132) and share HBM bandwidth, so the compute beside
# it runs that much slower. A fifth of the overlapped time is charged to the step, from that share,
# not fitted (leave-one-source-out: 12.7% -> 12.3% mean error over the bundled runs).
OVERLAP_DRAG = 0.2
DDP_FIRST_BUCKET = 2**20  # torch DDP's cap on the first bucket it rebuilds (dist._DEFAULT_FIRST_BUCKET_BYTES)
DDP_BUCKET = 25 * 2**20  # and on every later one (bucket_cap_mb = 25, in MiB)


# Host time of one small eager PyTorch op: its Python call, dispatch and kernel launch (5-25 µs on a
# GPU host; the low end, since a slice launches nothing)
EAGER_OP_S = 5e-6


def gather_copies_time(layout: Layout, shape: TrainShape, tensors: int) -> float:
    """Seconds the host spends issuing a sharded optimizer's gather one tensor at a time (nanotron's
    ZeRO-1: a slice and a copy per parameter tensor and data rank, `TrainShape.sharded_copies`). Each
    copy is a sliver of a tensor, so the host sets the pace, in series with the step."""
    n = shard_group(layout)
    if not shape.sharded_copies or layout.zero != 1 or n <= 1:  # its ZeRO-1 optimizer's gather
        return 0.0
    return 2 * tensors * n * EAGER_OP_S


def bucket_bytes(group: int) -> float:
    """Gradient bucket size over a data-parallel group: torch DDP's 25 MiB, grown with the group as
    Megatron does (a million elements per rank) so that a large ring's latency stays amortised."""
    return max(DDP_BUCKET, 4e6 * group)


def sub_module_gathers(
    modules: list[float], live_params: float, reuse_distance: float, recomputed: bool
) -> tuple[float, float, float]:
    """Gathers of a block under DeepSpeed-style sub-module gathering, in units of one pass over the
    block's parameters: (forward passes that wait in line, backward passes, backward passes that wait
    in line).

    DeepSpeed prefetches the next sub-modules while one computes, up to `live_params` (its
    `stage3_max_live_parameters`) less what is gathered already, so nothing is prefetched while a
    module of that size or more computes: the module after it is gathered when it is reached, with
    no compute beside the gather. Under full recompute the backward re-runs the block's forward, which
    gathers it again, and a module whose backward comes more than `reuse_distance` parameters after its
    recomputed forward (the rest of the block, forward and back) is released and gathered a third
    time. `modules`: the block's sub-module parameter counts in forward order (the next block's first
    follows the last). Without a bound (whole-block units, torch FSDP) one backward pass, all hidden."""
    total = sum(modules)
    if live_params <= 0 or total <= 0:
        return 0.0, 1.0, 0.0

    def waiting(order: list[float], gathered: list[bool]) -> float:
        before = order[-1:] + order[:-1]
        return (
            sum(size for size, prev, g in zip(order, before, gathered) if g and prev >= live_params) / total
        )

    every = [True] * len(modules)
    forward = waiting(modules, every)
    if not recomputed:
        return forward, 1.0, waiting(modules[::-1], every)
    again = [2 * sum(modules[i + 1 :]) >= reuse_distance > 0 for i in range(len(modules))]
    regathered = sum(size for size, g in zip(modules, again) if g) / total
    return forward, 1.0 + regathered, forward + waiting(modules[::-1], again[::-1])


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
    block_modules: list[float] | None = None,
    recomputed: float = 0.0,
    units: int = 1,
    tensors: int = 1,
    expert_units: int = 0,
    expert_rows: int = 0,
) -> None:
    """Record gradient (and ZeRO weight) traffic through `add`, each with the part no compute hides.

    FSDP gathers and reduces its `units` (the stage's blocks, embedding and head) one collective each,
    so each pass over the stage pays the ring's latency `units` times; ZeroRedundancyOptimizer
    broadcasts the stage's parameter `tensors` one each. Under ep, the experts of each of the stage's
    `expert_units` MoE layers are a unit of their own over `expert_fsdp` (as the ledger names it)."""
    z = layout.zero
    overlap = shape.overlap_grad_reduce and hw.comm_overlap and (z == 0 or shape.sharded_overlap)
    # after the whole schedule, one all-reduce a gradient tensor (fivefold's pipeline replicas)
    per_tensor = shape.replica_grads_per_tensor and layout.pp > 1 and layout.fsdp == 1 and layout.tp == 1
    overlap = overlap and not ((shape.reduce_after_pipeline or per_tensor) and layout.pp > 1)
    g, p = shape.grad_bytes, shape.param_bytes
    n = shard_group(layout)
    ep = layout.ep
    sharded_axes = ("fsdp", "cp") if layout.fsdp > 1 else ("dp", "cp")
    shard_link = worst_link(kinds, *sharded_axes)
    shard_axis = "fsdp" if layout.fsdp > 1 else "dp"
    per_node = ring_nics(layout, sharded_axes, shard_link, hw.gpus_per_node)

    # seconds of one micro-batch's forward and backward that no data-parallel collective covers yet:
    # collectives queued behind the same pass share it, so a window hides each second only once
    room = {"f": t_f, "b": t_b}

    def once(
        axis: str,
        op: str,
        payload: float,
        group: int,
        link: str,
        window: str,
        pieces: int = 0,
        passes: int = 1,
    ) -> None:
        """A step's gradient (or weight) traffic behind `passes` of the `window` pass ("f", "b"),
        issued in buckets as the backward frees them (or in `pieces`, FSDP's units): each pays the
        ring's latency, and the last one cannot hide behind any compute."""
        if group <= 1 or payload <= 0:
            return
        k = per_node if link == shard_link else 1
        if pieces:
            buckets = pieces
        elif shape.torch_ddp_buckets and op == ALL_REDUCE:  # as torch rebuilds them: 1 MiB, then 25 MiB
            buckets = 1 + max(0, math.ceil((payload - DDP_FIRST_BUCKET) / DDP_BUCKET))
        else:
            buckets = max(1, math.ceil(payload / bucket_bytes(group)))
        t = buckets * collective_time(hw, op, payload / buckets, group, link, k, axis)[1]
        hidden = passes * room[window] if overlap else 0.0
        exposed = max(t - hidden, t / buckets)
        room[window] = max(room[window] - (t - exposed) / passes, 0.0)
        add(
            axis,
            op,
            payload / buckets,
            group,
            link,
            buckets,
            exposed=exposed + OVERLAP_DRAG * (t - exposed),
            overlap="last backward" if overlap else "none",
            per_node=k,
        )

    n_exp = max(n // ep, 1)
    if z <= 1:
        # beside tp, fivefold's replicas are torch's `replicate` (DDP takes no DTensor weights): FSDP2's
        # units, one all-reduce each (ZeRO-1 over one data rank shards nothing: the same)
        replicate = (
            (z == 0 or layout.dp == 1) and layout.tp > 1 and layout.fsdp == 1 and shape.torch_ddp_buckets
        )
        whole = (replicate or per_tensor) and n_exp == n  # a block's experts go with it
        replicate = replicate and whole
        grads = (
            ((dense + experts, n, shard_link),)
            if whole
            else ((dense, n, shard_link), (experts, n_exp, shard_link))
        )
        for i, (payload, group, link) in enumerate(grads):
            if z == 0 or shape.zero1_broadcasts or replicate:  # the whole gradient, as DDP reduces it
                pieces = units if replicate else (tensors if per_tensor and i == 0 else 0)
                once(shard_axis, ALL_REDUCE, g * payload, group, link, "b", pieces)
            else:
                reduce = ALL_REDUCE if shape.sharded_copies else REDUCE_SCATTER
                once(shard_axis, reduce, g * payload, group, link, "b")
                once(shard_axis, ALL_GATHER, p * payload, group, link, "f")
        if z == 1 and shape.zero1_broadcasts and dense + experts > 0:
            # after the step every updated fp32 parameter, one tensor each, from the rank that owns
            # it (experts too: this ZeRO-1 runs without ep): nothing is left to hide them behind.
            # ZeroRedundancyOptimizer partitions over the dp ranks alone: cp ranks each keep a copy
            dp_link = worst_link(kinds, "dp")
            add(
                "dp",
                BROADCAST,
                MASTER_BYTES * (dense + experts) / tensors,
                layout.dp,
                dp_link,
                tensors,
                per_node=ring_nics(layout, ("dp",), dp_link, hw.gpus_per_node),
            )
    elif z == 2 and shape.params_kept:
        # DeepSpeed's ZeRO-2: weights stay whole across micro-batches; gradients are reduce-scattered
        # every micro-batch behind its backward, the updated shards gathered once a step
        for payload, group in ((dense, n), (experts, n_exp)):
            if group > 1 and payload > 0:
                t_rs = collective_time(hw, REDUCE_SCATTER, g * payload, group, shard_link, per_node)[1]
                t_hid = min(t_rs, room["b"]) if overlap else 0.0
                room["b"] -= t_hid
                add(
                    shard_axis,
                    REDUCE_SCATTER,
                    g * payload,
                    group,
                    shard_link,
                    m,
                    exposed=(t_rs - t_hid + OVERLAP_DRAG * t_hid) * m,
                    overlap="micro-batch backward",
                    per_node=per_node,
                )
                once(shard_axis, ALL_GATHER, p * payload, group, shard_link, "f")
    else:  # FSDP: gathers hide behind the micro-batch's forward, backward gathers and reduce-scatters
        # behind its backward (prefetching one layer ahead)
        # backward gather passes, and the passes that wait in line: one, all hidden, under torch
        # FSDP's block units; sub-module gathering (`block_modules`) weighs blocks full recompute
        # re-runs (`recomputed`) against the others
        waiting_f, bwd_gathers, waiting_b = 0.0, (1.0 if z == 3 else 0.0), 0.0
        if z == 3 and block_modules:
            plain, again = (
                sub_module_gathers(block_modules, shape.live_params, shape.reuse_distance, r)
                for r in (False, True)
            )
            waiting_f, bwd_gathers, waiting_b = (
                (1 - recomputed) * a + recomputed * b for a, b in zip(plain, again, strict=True)
            )
        units = max(units, 1)
        # (payload, group, axis, units) per shard: the dense one over `shard_axis` in `units` units, and
        # under ep the experts over expert_fsdp, one unit a MoE layer (fivefold.parallel.expert)
        own = ep > 1 and expert_units > 0
        # FSDP splits the stacked experts on dim 0, padded to its group: fewer than it, whole ones go
        experts *= expert_pad(expert_rows, n_exp)
        # without ep a block's experts are in its unit: one gather of both, not one each
        parts = ((dense, n, shard_axis, units), (experts, n_exp, "expert_fsdp", expert_units))
        if not own:
            parts = ((dense + experts, n, shard_axis, units),) if n_exp == n else parts
        shards = [(pl, grp, axis, u) for pl, grp, axis, u in parts if grp > 1 and pl > 0]
        # each unit's gather and reduction, issued by its hooks (their host dispatch included)
        t_ag, t_rs = (
            [
                u * collective_time(hw, op, b * pl / u, grp, shard_link, per_node, shard_axis)[1]
                for pl, grp, _, u in shards
            ]
            for op, b in ((ALL_GATHER, p), (REDUCE_SCATTER, g))
        )
        # torch's pipeline stage syncs FSDP gradients at the last backward of the step only (as
        # fivefold's ledger counts it): one reduce-scatter a step behind that backward, not m
        rs_each = not fsdp_sync_deferred(layout)
        busy_f = sum(t_ag)
        busy_b = bwd_gathers * busy_f + (sum(t_rs) if rs_each else 0.0)
        # gathers no prefetch can start early wait in line; the rest overlap the compute
        alone_f, alone_b = waiting_f * busy_f, waiting_b * busy_f
        if not hw.comm_overlap:  # nothing runs beside the compute: every gather and reduction waits
            alone_f, alone_b = busy_f, busy_b
        exposed_f = alone_f + max(busy_f - alone_f - t_f, 0.0) + OVERLAP_DRAG * min(busy_f - alone_f, t_f)
        exposed_b = alone_b + max(busy_b - alone_b - t_b, 0.0) + OVERLAP_DRAG * min(busy_b - alone_b, t_b)
        room["f"] -= min(busy_f - alone_f, t_f)
        room["b"] -= min(busy_b - alone_b, t_b)
        # inside a pipeline a ZeRO-3 unit stays gathered from a backward to the next forward (m + 1
        # gathers a step rather than 2m) and a ZeRO-2 unit from its first forward on (one gather),
        # as fsdp_gathers counts them for the ledger
        gathers = (1 + bwd_gathers) * m
        if layout.pp > 1:
            gathers = m + 1 if z == 3 else 1
        for i, (payload, group, axis, u) in enumerate(shards):
            ag_exposed = t_ag[i] / busy_f * exposed_f
            if busy_b > 0:
                ag_exposed += bwd_gathers * t_ag[i] / busy_b * exposed_b
            add(
                axis,
                ALL_GATHER,
                p * payload / u,
                group,
                shard_link,
                gathers * u,
                exposed=ag_exposed * m * gathers / ((1 + bwd_gathers) * m),
                overlap="micro-batch compute",
                per_node=per_node,
            )
            if not rs_each:
                once(axis, REDUCE_SCATTER, g * payload, group, shard_link, "b", u)
                continue
            add(
                axis,
                REDUCE_SCATTER,
                g * payload / u,
                group,
                shard_link,
                m * u,
                exposed=t_rs[i] / busy_b * exposed_b * m,
                overlap="micro-batch backward",
                per_node=per_node,
            )
        if layout.dp > 1 and layout.fsdp > 1:  # HSDP: replicas all-reduce their shard each sync
            syncs = m if rs_each else 1
            # each of FSDP2's units all-reduces its reduced shard; under ep each expert unit's
            # three stacked tensors go one by one (fivefold.parallel.expert)
            shares = [(dense / n, units), (experts / n_exp, 3 * expert_units)] if own else []
            for share, pieces in shares or [(dense / n + experts / n_exp, units)]:
                once(
                    "dp",
                    ALL_REDUCE,
                    syncs * g * share,
                    layout.dp,
                    kinds.get("dp", "inter"),
                    "b",
                    pieces,
                    syncs,
                )


# ---- the exact traffic of one step on one rank, as the comm ledger records it
#
# Units are those fivefold.parallel.data wraps: the embedding, each block, the final norm + head
# (a tied embedding and head share the first unit). FSDP gathers a unit's parameters in the
# compute dtype (padded to a multiple of the shard group) and reduce-scatters its fp32 gradients
# every micro-batch (once a step in a pipeline), HSDP then all-reduces the reduced shard over dp;
# `replicate` (tensor-parallel replicas) all-reduces each unit's gradients; DDP all-reduces its
# buckets (`ddp_buckets`: the first 1 MiB, then 25 MiB each); plain pipeline replicas all-reduce gradient by
# gradient; ZeRO-1 broadcasts each updated parameter from its owner. Experts sharded over ep are
# left to fivefold.plan.expert.


def units(run: RunShape, chunk: Chunk) -> list[list[str]]:
    """Parameter names of each FSDP/replicate unit of a chunk (experts under ep left out)."""
    spec = run.spec
    names = param_shapes(spec)
    keep = (lambda n: not is_expert(n)) if run.layout.ep > 1 else (lambda n: True)
    out: list[list[str]] = []
    # a pipeline's last chunk without the embedding holds its own copy of a tied weight
    own_head = "lm_head.weight" in names or (spec.tie_embeddings and not chunk.first)
    head = (["model.norm.weight"] + (["lm_head.weight"] if own_head else [])) if chunk.last else []
    if chunk.first:
        out.append(["model.embed_tokens.weight"] + (head if spec.tie_embeddings else []))
    by_layer = names_by_layer(spec)
    for i in chunk.layers:
        out.append([n for n in by_layer[i] if keep(n)])
    if head and not (spec.tie_embeddings and chunk.first):
        out.append(head)
    return out


def chunk_grads(run: RunShape, chunk: Chunk) -> list[int]:
    """Elements of each (tensor-parallel local) parameter of a chunk."""
    shapes = chunk_param_shapes(run.spec)
    return [
        numel(tp_local_shape(n, shapes[n], run.spec, run.layout.tp))
        for unit in units(run, chunk)
        for n in unit
    ]


def data_traffic(run: RunShape, chunks: list[Chunk]) -> Traffic:
    lay, spec = run.layout, run.spec
    out = Traffic()
    shapes = chunk_param_shapes(spec)
    gather_bytes = run.act_bytes  # FSDP's mixed precision gathers in the compute dtype
    if lay.fsdp > 1:
        n = lay.fsdp * lay.cp
        axis = replica_axis(lay, ("fsdp", "cp"))
        gathers, syncs = fsdp_gathers(run), run.fsdp_syncs
        for chunk in chunks:
            for unit in units(run, chunk):
                full = sum(padded(tp_local_shape(p, shapes[p], spec, lay.tp), n) for p in unit)
                out.add(axis, ALL_GATHER, gathers, full * gather_bytes)
                out.add(axis, REDUCE_SCATTER, syncs, full * GRAD_BYTES)
                out.add("dp", ALL_REDUCE, syncs if lay.dp > 1 else 0, full // n * GRAD_BYTES)
        return out
    replicas = lay.dp * lay.cp
    if replicas == 1:
        return out
    axis = replica_axis(lay, ("dp", "fsdp", "cp"))
    if lay.pp > 1 and lay.tp == 1:  # plain pipeline replicas: one all_reduce per gradient (dp × cp)
        for chunk in chunks:
            for size in chunk_grads(run, chunk):
                out.add(axis, ALL_REDUCE, 1, size * GRAD_BYTES)
    elif lay.tp > 1:  # `replicate`: each unit's gradients at once
        for chunk in chunks:
            for unit in units(run, chunk):
                size = sum(numel(tp_local_shape(p, shapes[p], spec, lay.tp)) for p in unit)
                out.add(axis, ALL_REDUCE, 1, size * GRAD_BYTES)
    else:  # DDP: its buckets as rebuilt after the first step
        sizes = [size * GRAD_BYTES for chunk in chunks for size in chunk_grads(run, chunk)]
        for bucket in ddp_buckets(sizes[::-1]):  # gradients become ready in reverse order
            out.add(axis, ALL_REDUCE, 1, bucket)
    if lay.zero == 1 and lay.dp > 1:  # ZeroRedundancyOptimizer: every parameter from its owner
        for chunk in chunks:
            for size in chunk_grads(run, chunk):
                out.add("dp", BROADCAST, 1, size * GRAD_BYTES)
    return out


def ddp_buckets(sizes: list[int]) -> list[int]:
    """Bytes of each bucket torch DDP all-reduces, for gradients of `sizes` bytes in the order they
    become ready: a bucket closes once it holds its cap (1 MiB for the first, 25 MiB after)."""
    out: list[int] = []
    current = 0
    for size in sizes:
        current += size
        if current >= (DDP_FIRST_BUCKET if not out else DDP_BUCKET):
            out.append(current)
            current = 0
    if current:
        out.append(current)
    return out


def fsdp_gathers(run: RunShape) -> int:
    """All-gathers per unit per step: each micro-batch's forward, and its backward under ZeRO-3.

    In a pipeline torch's stage does not reshard after the backward of any but the last micro-batch.
    Under ZeRO-2 the weights then stay gathered from the first forward on: one gather. Under ZeRO-3
    a forward still reshards, so every backward gathers again, while a forward that directly
    follows its chunk's backward finds the weights gathered: in the schedules ZeRO-3 runs with
    (no split backward) a chunk runs its warm-up forwards, then forward/backward pairs, then the
    remaining backwards, which makes m + 1 gathers (the warm-up forwards and the first forward of
    the steady state, then every backward).
    """
    if run.layout.pp > 1 and run.layout.zero == 2:
        return 1
    if run.layout.pp > 1 and run.layout.zero == 3:
        return run.microbatches + 1
    return run.microbatches * (2 if run.layout.zero == 3 else 1)


def loss_traffic(run: RunShape) -> Traffic:
    """The reported loss: the global mean, all-reduced over the ranks holding different data."""
    lay = run.layout
    out = Traffic()
    dims = ("dp", "fsdp", "cp") if lay.cp > 1 else ("dp", "fsdp")
    axis = replica_axis(lay, dims)
    if axis == "fsdp_cp" and not one_world_group(lay, lay.fsdp * lay.cp):  # the runner's dp×fsdp×cp
        # group, a group of its own beside FSDP's fsdp×cp one over the same ranks
        axis = "dp_fsdp_cp"
    out.add(axis, ALL_REDUCE, 1, 4)
    return out
