"""Parameters, gradients and optimizer state one rank holds (fp32 master weights, AdamW's two moments).

Each parameter of the rank's chunks is cut as the runtime cuts it: its tensor-parallel local shape,
experts E/ep under expert parallelism (then chunked over expert_fsdp with fsdp), the rest's dim 0
chunked over fsdp×cp by FSDP (torch.chunk rows:
the last rank may hold fewer). Gradients match the parameters. AdamW keeps exp_avg and exp_avg_sq
of every parameter it steps; ZeRO-1 (ZeroRedundancyOptimizer) only of those its greedy partition
gives this dp rank (largest first, each to the least-loaded rank, decay group then no-decay group).
"""

from __future__ import annotations

from fivefold.layout_math import (
    chunk_param_shapes,
    chunk_rows,
    is_expert,
    names_by_layer,
    numel,
    rank_local_shape,
)
from fivefold.plan.dataparallel import units
from fivefold.plan.runshape import Chunk, RunShape

STATE_BYTES = 4  # fp32 master weights, gradients and moments (bf16 runs compute in 2 bytes only)


def local_shapes(run: RunShape, chunk: Chunk, coords: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """name -> the shape this rank stores of each parameter of `chunk`."""
    lay, spec = run.layout, run.spec
    shapes = chunk_param_shapes(spec)
    names = [n for unit in units(run, chunk) for n in unit]
    if lay.ep > 1:
        by_layer = names_by_layer(spec)
        names += [n for i in chunk.layers for n in by_layer[i] if is_expert(n)]
    out = {}
    for name in names:
        local = rank_local_shape(name, shapes[name], spec, lay.tp, lay.ep)
        if lay.ep > 1 and is_expert(name):
            expert_fsdp = lay.fsdp * lay.cp // lay.ep
            if lay.fsdp > 1 and expert_fsdp > 1:  # FSDP over expert_fsdp (parallel.expert.shard_experts)
                index = coords["fsdp_cp"] // lay.ep  # the expert_fsdp coordinate (mesh.py)
                local = (chunk_rows(local[0], expert_fsdp, index), *local[1:])
        elif lay.fsdp > 1:
            local = (chunk_rows(local[0], lay.fsdp * lay.cp, coords["fsdp_cp"]), *local[1:])
        out[name] = local
    return out


def state_bytes(run: RunShape, chunks: list[Chunk], coords: dict[str, int]) -> dict[str, int]:
    params = grads = optimizer = 0
    for chunk in chunks:
        shapes = local_shapes(run, chunk, coords)
        held = sum(numel(s) for s in shapes.values()) * STATE_BYTES
        params += held
        grads += held
        if run.layout.zero == 1 and run.layout.dp > 1 and run.layout.fsdp == 1:
            optimizer += 2 * zero_partition(list(shapes.values()), run.layout.dp)[coords["dp"]] * STATE_BYTES
        else:
            optimizer += 2 * held
    return {"params": params, "grads": grads, "optimizer": optimizer}


def zero_partition(shapes: list[tuple[int, ...]], ranks: int) -> list[int]:
    """Elements each rank owns under ZeroRedundancyOptimizer (decay group, then no-decay)."""
    sizes = [0] * ranks
    for group in ([s for s in shapes if len(s) >= 2], [s for s in shapes if len(s) < 2]):
        for shape in sorted(group, key=numel, reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += numel(shape)
    return sizes
