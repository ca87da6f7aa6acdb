"""What a layout should send and hold, from the model's shapes and the layout alone.

Written from the sharding rules (Megatron TP, FSDP dim-0 sharding with padding, DDP buckets),
not from the code that applies them, so the multi-rank tests can compare the comm ledger and the
memory meter against it. Byte counts are fp32 (4 bytes per element).
"""

from __future__ import annotations

import math
from collections import defaultdict

from fivefold.config import Layout, ModelSpec

F32 = 4


def param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The single-process model's parameter shapes, by name, from the spec (no torch needed)."""
    h, d, f, v = spec.hidden, spec.head_dim, spec.ffn_hidden, spec.vocab
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (spec.heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (spec.kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (spec.kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, spec.heads * d)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if spec.is_moe_layer(i):
            e, fe = spec.experts, spec.expert_ffn_hidden
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.experts.gate_proj"] = (e, fe, h)
            shapes[p + "mlp.experts.up_proj"] = (e, fe, h)
            shapes[p + "mlp.experts.down_proj"] = (e, h, fe)
            if spec.shared_experts:
                fs = fe * spec.shared_experts
                shapes[p + "mlp.shared_expert.gate_proj.weight"] = (fs, h)
                shapes[p + "mlp.shared_expert.up_proj.weight"] = (fs, h)
                shapes[p + "mlp.shared_expert.down_proj.weight"] = (h, fs)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def tp_local_shape(name: str, shape: tuple[int, ...], spec: ModelSpec, tp: int) -> tuple[int, ...]:
    """Megatron splits: column-parallel on dim 0, row-parallel on dim 1, MoE and norms whole."""
    if tp == 1 or ".mlp.gate." in name or ".experts." in name or "shared_expert" in name or len(shape) == 1:
        return shape
    if name.endswith(("k_proj.weight", "v_proj.weight")) and tp > spec.kv_heads:
        return shape  # KV heads replicated: every rank keeps the whole projection
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return (shape[0], shape[1] // tp)
    return (shape[0] // tp, *shape[1:])  # q/k/v, gate/up, vocabulary rows of embedding and head


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def padded(shape: tuple[int, ...], n: int) -> int:
    """Elements of the full tensor once dim 0 is padded to a multiple of n (FSDP2)."""
    return math.ceil(shape[0] / n) * n * numel(shape[1:])


def chunk_rows(rows: int, n: int, index: int) -> int:
    """Rows rank `index` of n holds when dim 0 is chunked (torch.chunk, the DTensor rule)."""
    per = math.ceil(rows / n)
    return max(0, min(per, rows - index * per))


def units(spec: ModelSpec) -> list[list[str]]:
    """FSDP/replicate units: embedding, each block, final norm + head."""
    names = list(param_shapes(spec))
    out = [["model.embed_tokens.weight"]]
    out += [[n for n in names if n.startswith(f"model.layers.{i}.")] for i in range(spec.layers)]
    out.append(["model.norm.weight", "lm_head.weight"])
    return out


def replica_axis(layout: Layout) -> str | None:
    """The axis name the ledger gives the loss all-reduce over dp×fsdp (cp = 1 here)."""
    split = [a for a in ("dp", "fsdp") if getattr(layout, a) > 1]
    return None if not split else (split[0] if len(split) == 1 else "batch")


def expected_forward_backward(
    spec: ModelSpec,
    layout: Layout,
    micro_batch: int,
    seq: int,
    accumulation: int,
    received: int | None = None,
) -> dict[tuple[str, str], tuple[int, int]]:
    """(axis, op) -> (count, bytes) for one optimizer step's forward and backward passes.

    With expert parallelism the experts leave the FSDP units and DDP, and `received` (the rows this
    rank's experts got in the step, which routing decides) is needed: see `expected_expert_parallel`.
    """
    out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(axis: str, op: str, count: int, nbytes: int) -> None:
        out[(axis, op)][0] += count
        out[(axis, op)][1] += count * nbytes

    shapes = param_shapes(spec)
    if layout.ep > 1:
        assert received is not None, "expert parallelism: pass the rows this rank's experts received"
        for key, (count, nbytes) in expected_expert_parallel(
            spec, layout, micro_batch, seq, accumulation, received
        ).items():
            out[key][0] += count
            out[key][1] += nbytes
        shapes = {n: s for n, s in shapes.items() if ".experts." not in n}
    tp, fsdp, dp = layout.tp, layout.fsdp, layout.dp
    local = {n: tp_local_shape(n, s, spec, tp) for n, s in shapes.items()}
    act = micro_batch * seq * spec.hidden * F32  # one b·s·h activation
    moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.layers))
    dense_layers = spec.layers - moe_layers
    if tp > 1:
        # per micro-batch: embedding (fwd) and head (bwd) + per block: attention in and out,
        # MLP in and out, each once per pass; MoE MLPs run replicated, only gathered / handed back
        if layout.sp:
            add("tp", "all_gather", accumulation * (2 + 4 * spec.layers), act)
            add("tp", "reduce_scatter", accumulation * (2 + 4 * dense_layers + 2 * moe_layers), act)
            # SP norm weights' partial gradients: with each FSDP gradient sync, else once per step
            norms = (2 * spec.layers + 1) * (accumulation if fsdp > 1 else 1)
            add("tp", "all_reduce", norms, spec.hidden * F32)
        else:
            add("tp", "all_reduce", accumulation * (2 + 4 * dense_layers + 2 * moe_layers), act)
        # the loss on vocabulary shards (loss_parallel): max logit, sum of exponentials and the
        # target logit, one fp32 value per token each, all-reduced inside DTensor's dispatch
        add("tp", "all_reduce", 3 * accumulation, micro_batch * seq * F32)
        if tp > spec.kv_heads:  # replicated K/V projections: their partial weight gradients
            add("tp", "all_reduce", 2 * spec.layers, spec.kv_heads * spec.head_dim * spec.hidden * F32)
    unit_list = [[n for n in unit if n in shapes] for unit in units(spec)]
    if fsdp > 1:
        passes = 2 if layout.zero == 3 else 1  # zero 3 gathers again in backward
        for unit in unit_list:
            full = sum(padded(local[n], fsdp) for n in unit) * F32
            add("fsdp", "all_gather", accumulation * passes, full)
            add("fsdp", "reduce_scatter", accumulation, full)  # every micro-batch's gradients
            if dp > 1:  # HSDP: the reduced shard is averaged across replicas
                add("dp", "all_reduce", accumulation, full // fsdp)
    elif dp > 1 and tp > 1:  # replicate per unit
        for unit in unit_list:
            add("dp", "all_reduce", 1, sum(numel(local[n]) for n in unit) * F32)
    elif dp > 1:  # DDP: every gradient once; a model this small fits in one bucket
        add("dp", "all_reduce", 1, sum(numel(s) for s in shapes.values()) * F32)
    axis = replica_axis(layout)
    if axis is not None:
        add(axis, "all_reduce", 1, F32)  # the mean loss over the global batch
    return {k: (c, b) for k, (c, b) in out.items()}


def expected_expert_parallel(
    spec: ModelSpec,
    layout: Layout,
    micro_batch: int,
    seq: int,
    microbatches: int,
    received: int,
    layers: list[int] | None = None,
) -> dict[tuple[str, str], tuple[int, int]]:
    """(axis, op) -> (count, bytes) of the experts in one step's forward and backward on one rank.

    `layers` are the rank's layers (all without a pipeline); `received` the rows its experts got.
    Per MoE layer and micro-batch, on `ep`: the [E] int64 row counts exchanged; every token of the
    rank's sequence shard sent to each of its top-k experts (micro_batch·seq/cp·k rows, whole under
    tp: the MoE block runs on the gathered sequence) and the results of the received rows sent
    back, hidden × 4 bytes a row; in backward the gradients of both go the other way.
    The experts each rank holds, E/ep of each expert weight, are shared by the fsdp·cp/ep ranks of
    `expert_fsdp` and by dp. With fsdp they are one FSDP unit per layer over expert_fsdp (dim 0
    padded to a multiple of it: gathered in each forward, and again in backward under ZeRO-3,
    reduce-scattered once), whose reduced shard is all-reduced over dp weight by weight; without
    FSDP over them every expert gradient is all-reduced over expert_fsdp, then dp.
    """
    out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(axis: str, op: str, count: int, nbytes: int) -> None:
        out[(axis, op)][0] += count
        out[(axis, op)][1] += count * nbytes

    layers = list(range(spec.layers)) if layers is None else layers
    moe = [i for i in layers if spec.is_moe_layer(i)]
    calls = microbatches * len(moe)
    sent = calls * micro_batch * seq // layout.cp * spec.experts_per_token
    row = spec.hidden * F32
    add("ep", "all_to_all", calls, spec.experts * 8)  # the counts
    out[("ep", "all_to_all")][0] += 4 * calls  # rows there and back, forward and backward
    out[("ep", "all_to_all")][1] += 2 * (sent + received) * row
    shapes = param_shapes(spec)
    expert_fsdp = layout.fsdp * layout.cp // layout.ep
    passes = 2 if layout.zero == 3 else 1
    # every micro-batch's gradients, but once a step in a pipeline (its stage defers the sync)
    syncs = microbatches if layout.pp == 1 else 1
    for i in moe:
        names = [n for n in shapes if n.startswith(f"model.layers.{i}.mlp.experts.")]
        local = {n: (shapes[n][0] // layout.ep, *shapes[n][1:]) for n in names}
        if layout.fsdp > 1 and expert_fsdp > 1:
            full = sum(padded(s, expert_fsdp) for s in local.values()) * F32
            add("expert_fsdp", "all_gather", microbatches * passes, full)
            add("expert_fsdp", "reduce_scatter", syncs, full)
            for s in local.values():
                if layout.dp > 1:
                    add("dp", "all_reduce", syncs, padded(s, expert_fsdp) // expert_fsdp * F32)
            continue
        for s in local.values():
            for axis, size in (("expert_fsdp", expert_fsdp), ("dp", layout.dp)):
                if size > 1:
                    add(axis, "all_reduce", 1, numel(s) * F32)
    return {k: (c, b) for k, (c, b) in out.items()}


def expected_stage_p2p(
    spec: ModelSpec, layout: Layout, micro_batch: int, seq: int, microbatches: int, pp_rank: int
) -> dict[tuple[str, str], tuple[int, int]]:
    """Pipeline hand-overs of one step on one rank (one chunk per rank): each micro-batch's
    activation [b, s/cp (/tp with SP), h] sent to the next stage and its gradient sent back, so a
    rank sends and receives one tensor per micro-batch per neighbour stage."""
    assert layout.virtual_stages == 1
    neighbours = (pp_rank > 0) + (pp_rank < layout.pp - 1)
    act = micro_batch * seq // layout.cp // (layout.tp if layout.sp else 1) * spec.hidden * F32
    count = microbatches * neighbours
    return {("pp", "send"): (count, count * act), ("pp", "recv"): (count, count * act)}


def expected_state_bytes(spec: ModelSpec, layout: Layout, coords: dict[str, int]) -> dict[str, int]:
    """Bytes of params, grads and AdamW state (exp_avg + exp_avg_sq) this rank holds.

    FSDP: each (TP-local) tensor chunked on dim 0 over fsdp (the last rank may hold fewer rows:
    its padding lives in the parameter's storage only, see `expected_param_storage`).
    ZeRO-1: the optimizer state of the parameters ZeroRedundancyOptimizer's greedy partition
    gives this rank (largest first, each to the least-loaded rank, per parameter group).
    """
    shapes = param_shapes(spec)
    held = {}
    for name, shape in shapes.items():
        local = tp_local_shape(name, shape, spec, layout.tp)
        if layout.fsdp > 1:
            local = (chunk_rows(local[0], layout.fsdp, coords["fsdp"]), *local[1:])
        held[name] = numel(local) * F32
    params = sum(held.values())
    optimizer = 2 * params
    if layout.zero == 1 and layout.dp > 1:
        optimizer = 2 * zero_partition(spec, layout.dp)[coords["dp"]]
    return {"params": params, "grads": params, "optimizer": optimizer}


def zero_partition(spec: ModelSpec, ranks: int) -> list[int]:
    """Parameter bytes each rank owns under ZeroRedundancyOptimizer (decay group, then no-decay)."""
    shapes = param_shapes(spec)
    sizes = [0] * ranks
    for group in ([s for s in shapes.values() if len(s) >= 2], [s for s in shapes.values() if len(s) < 2]):
        for shape in sorted(group, key=numel, reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += numel(shape)
    return [s * F32 for s in sizes]


def expected_param_storage(spec: ModelSpec, layout: Layout) -> int:
    """FSDP: bytes of parameter storage per rank, padding included: padded / fsdp per tensor."""
    return sum(
        padded(tp_local_shape(n, s, spec, layout.tp), layout.fsdp) // layout.fsdp * F32
        for n, s in param_shapes(spec).items()
    )
