"""One step of a concrete run on one rank, planned axis by axis: every collective the comm ledger
will record (axis, op, calls, bytes) and the state bytes the rank holds.

Each axis plans its own share (fivefold.plan.tensor, .context, .expert, .pipeline, .dataparallel);
this module places the rank (its coordinates, its pipeline chunks), adds the gradient-norm
reductions of clipping, and sums. `fivefold verify` compares the result with the measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.config import Layout, ModelSpec
from fivefold.layout_math import (
    ALL_REDUCE,
    chunk_param_shapes,
    chunk_rows,
    end_ranks,
    one_world_group,
    param_shapes,
    replica_axis,
    tp_local_shape,
)
from fivefold.plan.context import context_traffic
from fivefold.plan.dataparallel import data_traffic, loss_traffic, units
from fivefold.plan.expert import expert_traffic
from fivefold.plan.pipeline import pipeline_traffic
from fivefold.plan.runshape import Chunk, RunShape, Traffic
from fivefold.plan.state import STATE_BYTES, state_bytes
from fivefold.plan.tensor import tensor_traffic


@dataclass
class StepPlan:
    comm: dict[tuple[str, str], tuple[int, int]]  # (axis, op) -> (calls, bytes) of the whole step
    state: dict[str, int]  # params, grads, optimizer bytes
    by_axis: dict[str, dict[tuple[str, str], tuple[int, int]]] = field(default_factory=dict)


def plan_step(
    spec: ModelSpec,
    layout: Layout,
    micro_batch: int,
    seq_len: int,
    microbatches: int,
    dtype: str,
    coords: dict[str, int],
    rows_received: int | None = None,
    rows_received_once: int | None = None,
) -> StepPlan:
    """The step of the rank at `coords` (mesh coordinates by axis, fsdp_cp included); with expert
    parallelism, the rows its experts received in the step's forwards (measured: routing decides
    them), all of them and with the recomputed forwards counted once."""
    run = RunShape(spec, layout, micro_batch, seq_len, microbatches, dtype)
    chunks = run.chunks(coords.get("pp", 0))
    parts = {
        "tp": tensor_traffic(run, chunks),
        "cp": context_traffic(run, chunks),
        "ep": expert_traffic(run, chunks, rows_received, rows_received_once),
        "pp": pipeline_traffic(run, coords.get("pp", 0)).merge(tied_traffic(run, chunks, coords)),
        "data": data_traffic(run, chunks).merge(loss_traffic(run)),
        "clip": clip_traffic(run, chunks),
    }
    total = Traffic()
    for part in parts.values():
        total.merge(part)
    return StepPlan(
        total.as_dict(), state_bytes(run, chunks, coords), {k: v.as_dict() for k, v in parts.items()}
    )


def tied_traffic(run: RunShape, chunks: list[Chunk], coords: dict[str, int]) -> Traffic:
    """Tied embeddings split by a pipeline: the first chunk's embedding and the last chunk's head are
    one weight, and the two pp ranks that hold them sum its gradient (fivefold.parallel.pipeline_runner)
    after the schedule, one fp32 all_reduce of the local shard per copy this rank holds."""
    lay, spec = run.layout, run.spec
    out = Traffic()
    if not spec.tie_embeddings or lay.pp == 1:
        return out
    first, last = end_ranks(lay)
    copies = sum(c.first for c in chunks) + sum(c.last for c in chunks)
    if first == last or not copies:  # one rank holds both (a V-shaped schedule): summed locally
        return out
    name = "model.embed_tokens.weight"
    rows = tp_local_shape(name, param_shapes(spec)[name], spec, lay.tp)[0]
    if lay.fsdp > 1:  # the gradient is the local shard's (dim 0 chunked over fsdp×cp)
        rows = chunk_rows(rows, lay.fsdp * lay.cp, coords.get("fsdp_cp", 0))
    out.add("pp", ALL_REDUCE, copies, rows * spec.hidden * STATE_BYTES)
    return out


def clip_traffic(run: RunShape, chunks: list[Chunk]) -> Traffic:
    """The global gradient norm: one fp64 all_reduce per group of each distinct gradient sharding
    (fivefold.parallel.gradnorm), and one over pp for the stages' sums."""
    lay, spec = run.layout, run.spec
    shapes = chunk_param_shapes(spec)
    fsdp_axis = replica_axis(lay, ("fsdp", "cp")) if lay.fsdp > 1 else None
    shardings: set[tuple[str, ...]] = set()
    for chunk in chunks:
        for unit in units(run, chunk):
            for name in unit:
                tp_split = lay.tp > 1 and tp_local_shape(name, shapes[name], spec, lay.tp) != shapes[name]
                groups = tuple(a for a, on in ((fsdp_axis, fsdp_axis is not None), ("tp", tp_split)) if on)
                shardings.add(groups)
        if lay.ep > 1 and any(spec.is_moe_layer(i) for i in chunk.layers):
            # experts are sharded on the ep mesh (and FSDP's expert_fsdp with fsdp); when ep spans
            # all of fsdp×cp its ranks are FSDP's group, and the runtime reduces both in one call on
            # the group it met first (FSDP's)
            ep_axis = "ep"
            if lay.fsdp > 1 and lay.fsdp * lay.cp > lay.ep:
                shardings.add(("expert_fsdp", ep_axis))
            elif lay.fsdp == 1 and lay.ep == lay.cp and one_world_group(lay, lay.cp):  # ep's group is
                # cp's, which the ledger names after cp
                shardings.add(("cp",))
            else:
                same = fsdp_axis is not None and lay.ep == lay.fsdp * lay.cp
                shardings.add((fsdp_axis,) if same else (ep_axis,))
    out = Traffic()
    for groups in shardings:
        for axis in groups:
            out.add(axis, ALL_REDUCE, 1, 8)
    if lay.pp > 1:
        out.add("pp", ALL_REDUCE, 1, 8)
    return out
