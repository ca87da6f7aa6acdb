"""Bytes autograd saves for the backward on one rank at its peak: the saved-tensor count of the
runtime's own model code (fivefold.model), which `fivefold verify` measures with saved-tensor hooks.

This is the count of what this implementation keeps (every tensor each op saves, once per storage),
not the HBM estimate of `fivefold.plan.memory`, which models fused production kernels.

Per layer and micro-batch, T tokens on the rank (its cp shard), n = T/tp with SP else T, in the
run's dtypes (fp32 stream under autocast, matmul outputs in the compute dtype):
  * each RMSNorm: its input, the fp32 reciprocal RMS (n values), its output, and the projection's
    input (the gathered sequence under SP; cast once to the compute dtype before attention and a
    dense MLP, per projection before an MoE layer under autocast);
  * the residual stream at both norms' inputs (the block's input and the residual between halves);
  * attention: rotary q and k, v (the whole replicated projection's output where tp exceeds the
    KV heads: the rank's heads are a view of it), the output (the output projection saves a view
    of it), and the fp32 log-sum-exp (one per query head and token); under Ulysses the kernel's
    sequence-layout q, k, v (K and V one per query head where the KV heads do not split over cp),
    the rotary q beside them, and the two position orders; under all-gather cp the gathered K and V
    and the causal mask (additive, in the compute dtype); ring cp keeps q and k as they come (the
    stream dtype) and its output in fp32, which in 16 bits the output projection casts and saves;
  * SwiGLU: gate, silu(gate), up and their product (f/tp wide).
Once per micro-batch: the rotary table, and on the last stage the final norm (its input too: the
last block's output), the logits and their log-softmax (fp32, vocab/tp wide). Once per step: the
rank's batch of token ids and of targets, of which each micro-batch is a view (with cp, each
micro-batch's sequence shard is a copy of its own). Selective recompute drops the attention core's
saved tensors (q and k in the stream dtype, v and the output are kept at its boundary); full
recompute keeps each recomputed block's input (every block's, or the first `recompute_layers` of
each chunk's; a stage's first block's input is what it received), and the rotary table only where
a block runs whole. Expert parallelism adds the dispatch's and the
combine's row orders (`routed_row_bytes`), and in bf16 where FSDP does not shard the experts the
per-forward bf16 copies of this rank's expert weights (`_expert_weight_casts`).
"""

from __future__ import annotations

import dataclasses

from fivefold.config import Layout, ModelSpec
from fivefold.plan.runshape import Chunk, RunShape


def _linear_inputs(run: RunShape, t: int, h: int, consumers: int) -> float:
    """A norm's output as an MoE layer's projections save it: one fp32 (or FSDP bf16) tensor they
    share, or under autocast one bf16 cast per projection (autocast caches weight casts, not inputs)."""
    return consumers * t * h * 2 if run.autocast else t * h * run.act_bytes


def _matmul_input(run: RunShape, t: int, h: int) -> float:
    """A norm's output as attention's and a dense MLP's projections save it: cast once to the
    compute dtype by the block (`fivefold.model.transformer`) and shared."""
    return t * h * run.act_bytes


def _weights(run: RunShape, elements: float) -> float:
    """Autocast's bf16 copies of fp32 weights, saved for the input gradient."""
    return 2 * elements if run.autocast else 0.0


def layer_saved(run: RunShape, moe: bool, recomputed: bool | None = None) -> float:
    """Saved bytes of one block for one micro-batch; `recomputed`: whether full recompute re-runs
    this block (default: every block under full recompute)."""
    spec, lay = run.spec, run.layout
    t, tp, h, d = run.tokens, lay.tp, spec.hidden, spec.head_dim
    n = t // tp if lay.sp else t
    st, mm = run.stream_bytes, run.act_bytes
    if lay.recompute == "full" if recomputed is None else recomputed:  # the input, kept by the checkpoint
        return n * h * st
    heads = spec.heads // tp
    kv = spec.kv_heads // tp if tp <= spec.kv_heads else 1
    kv_rows = spec.kv_heads if tp > spec.kv_heads else kv  # replicated projections stay whole
    bf16_weights = mm == 2 and not run.autocast  # FSDP / `replicate` cast the weights to bf16
    # a norm keeps the fp32 reciprocal RMS and normalised tensor; with bf16 weights also the fp32
    # copy of its input and the bf16 normalised tensor its weight multiplies
    fp32_norm = 4 * n + 4 * n * h + (2 * n * h if bf16_weights else 0)
    mlp_consumers = (1 + 2 * (spec.experts > 0)) if moe else 2
    mlp_input = _linear_inputs(run, t, h, mlp_consumers) if moe else _matmul_input(run, t, h)
    norms = 2 * fp32_norm + _matmul_input(run, t, h) + mlp_input
    # the two norms' inputs in the stream dtype: the block's input and the residual between the
    # halves; with bf16 weights the norms' fp32 input copies are what is kept
    stream = 0 if bf16_weights else 2 * n * h * st
    # Ulysses gives each query head its own K/V copy where the KV heads do not split over cp
    # (fivefold.parallel.context): the kernel then saves as many K and V heads as query heads
    # (made inside the core: selective recompute's checkpoint keeps the KV heads as they enter it)
    inside = lay.recompute != "selective"  # what the core saves inside itself (not under selective)
    kv_saved = heads if inside and lay.cp > 1 and lay.cp_impl == "ulysses" and kv % lay.cp else kv
    q, k = t * heads * d, t * kv_saved * d
    # v as the core saves it: this rank's heads of v_proj's output, a view that holds the whole
    # output where the projection is replicated over tp (more ranks than KV heads)
    v = t * kv_rows * d if kv_saved == kv else k
    # rotary q and k as the core saves them, in the compute dtype (the kernel casts them under
    # autocast), and the output; the output projection saves a view of it
    qk_bytes, out_bytes, out_copy = mm, mm, 0
    if not inside:  # the checkpoint keeps q, k as they enter it (the stream dtype);
        qk_bytes = st  # the output projection saves the recomputed core's output
    elif lay.cp > 1 and lay.cp_impl == "ring":  # the ring keeps q, k as given and merges in fp32:
        # its fp32 output is saved, and in 16 bits the output projection saves a cast of it
        qk_bytes, out_bytes, out_copy = st, 4, (2 * q if mm == 2 else 0)
    core = (q + k) * qk_bytes + v * mm + q * out_bytes + out_copy
    if inside:  # the fp32 log-sum-exp, one per query head and token
        core += 4 * t * heads
    if inside and lay.cp > 1 and lay.cp_impl == "ulysses":
        # the kernel saves its own sequence-layout q, k, v (counted above); the rotary q in head layout
        # stays saved beside them, and the two position orders (int64 over the whole sequence) too
        # (measured: tiny at cp 2 and cp 4, and with tp 2, to the byte)
        core += q * mm + 2 * 8 * run.seq_len
    if inside and lay.cp > 1 and lay.cp_impl == "allgather":
        # the kernel saves the gathered whole-sequence K and V (the rest of them beyond this rank's
        # shard, counted above) and the causal mask of this shard's rows over every column, which
        # SDPA turns from booleans into an additive mask in the compute dtype
        rest = run.micro_batch * run.seq_len - t
        core += rest * kv * d * 2 * mm + run.seq_len // lay.cp * run.seq_len * mm
    # the output projection saves a view of the kernel's output (counted in `core`)
    attn = core + _weights(run, (2 * spec.heads * d) * h / tp + 2 * kv_rows * d * h)
    if spec.qk_norm:  # per-head q/k norms: the fp32 reciprocal RMS per head and token, and
        # in fp32 their input and output (k's input a view of the whole replicated projection);
        # in 16 bits the fp32 copy of their input and their output in the compute dtype
        k_local = t * kv * d
        if mm == 4:
            attn += 8 * q + 4 * (t * kv_rows * d + k_local)
        else:
            attn += (4 + mm) * (q + k_local)
        attn += 4 * t * (heads + kv)
    if moe:
        mlp = _moe_saved(run, _moe_tokens(run))
    else:
        f = spec.ffn_hidden // tp
        mlp = 4 * t * f * mm + _weights(run, 3 * f * h)
    return norms + stream + attn + mlp


def _moe_saved(run: RunShape, t: int) -> float:
    """Router, sorted rows, each expert's SwiGLU on its rows, the weighted combine, shared expert.

    Under autocast each expert's weights are cast per call (slices of one tensor: not cached) and
    its rows cast for gate and up; the combine's weighting promotes to fp32. The rows this rank's
    experts receive count `routed_row_bytes` each; balanced, a rank receives as many as it sends."""
    spec = run.spec
    h, e, k, fe, mm = spec.hidden, spec.experts, spec.experts_per_token, spec.expert_ffn_hidden, run.act_bytes
    fs = fe * spec.shared_experts
    rows = k * t
    received = rows * routed_row_bytes(run)
    router = _router_past_matmul(t, e, rows) + _weights(run, e * h)
    aux = _balancing_saved(run)
    if run.autocast:  # each of this rank's experts (E/ep) casts its weights; the combine keeps its
        # bf16 rows and their fp32 weighting
        sort = 8 * rows + 8 * rows + 4 * rows
        experts = 2 * 3 * fe * h * (e // run.layout.ep) + rows * h * 2 + rows * h * 4
        shared = 2 * 3 * fs * h + 4 * t * fs * 2
        return router + sort + experts + received + shared + aux
    # the sorted rows and the combine's two saved tensors are in the compute dtype (bf16 weights:
    # bf16 rows), measured on tiny-moe in fp32 and bf16
    sort = 8 * rows + mm * rows * h + 8 * rows + mm * rows
    combine = mm * rows * h
    shared = 4 * t * fs * mm
    return router + sort + combine + received + shared + aux + _expert_weight_casts(run)


def _moe_tokens(run: RunShape) -> int:
    """Tokens an MoE block routes on a rank: all of them with sp too (its input is gathered whole)."""
    lay, t = run.layout, run.tokens
    return t // lay.tp * lay.tp if lay.sp else t


def _router_past_matmul(t: int, experts: int, rows: int) -> float:
    """What the router saves after its matmul: the fp32 softmax, the top-k indices (int64), the
    gathered weights and their sum (fp32)."""
    return 4 * t * experts + 8 * rows + 4 * rows + 4 * t


def _balancing_saved(run: RunShape) -> float:
    """The balancing loss keeps the load per sequence and expert; with cp also the cp-summed
    statistics it multiplies (counts and probabilities, `fivefold.parallel.context`)."""
    return 4 * run.micro_batch * run.spec.experts * (3 if run.layout.cp > 1 else 1)


def _moe_tail(run: RunShape, t: int) -> float:
    """What an MoE block saves above its last weights: the router past its matmul (softmax, top-k
    indices, the normalised weights and their sum), the row order, and the weighted combine (the
    experts' output and its weights, and the sum's source), with the balancing loss's statistics.
    No parameter's gradient needs them, so a split backward's input pass frees them where nothing
    above the block holds its graph (`input_pass_frees`). Under autocast the experts' output is
    bf16 and its weighting promotes to fp32 (measured on tiny-moe: 9,296 bytes in fp32, 7,248 in
    bf16 autocast, a block's 16 tokens)."""
    spec, mm = run.spec, run.act_bytes
    rows = spec.experts_per_token * t
    if run.autocast:
        combine = 4 * rows + 2 * rows * spec.hidden + 4 * rows * spec.hidden
    else:
        combine = mm * rows + 2 * mm * rows * spec.hidden
    return _router_past_matmul(t, spec.experts, rows) + 8 * rows + combine + _balancing_saved(run)


def input_pass_frees(run: RunShape, chunk: Chunk) -> float:
    """Bytes of one micro-batch a split backward's input pass (I) frees on `chunk`. It keeps every
    node a parameter's gradient still needs for the weight pass (W), and lets go of the nodes above
    all of them: the last chunk's loss (its head lies above the blocks), and on a chunk in the middle
    of the pipeline the tail of its last block when that block is MoE (a dense block ends in its
    down projection and a residual add, which save nothing). The first stage has no input gradient
    to compute: its input pass frees nothing. With expert parallelism the combine runs through the
    all-to-all and is not counted here."""
    if chunk.last:
        return loss_saved(run, chunk, ids=False)
    last, lay = chunk.layers[-1] if chunk.layers else None, run.layout
    if chunk.first or last is None or not run.spec.is_moe_layer(last) or lay.ep > 1:
        return 0.0
    if last in run.again([chunk]):  # a recomputed block keeps only its input until its backward
        return 0.0
    return _moe_tail(run, _moe_tokens(run))


def _expert_weight_casts(run: RunShape) -> float:
    """Expert parallelism (fivefold.parallel.expert) in bf16 where FSDP does not shard the experts
    (no expert_fsdp): the per-forward bf16 copies of this rank's expert weights."""
    spec, lay = run.spec, run.layout
    expert_fsdp = lay.fsdp * lay.cp // lay.ep if lay.fsdp > 1 else 1
    if lay.ep == 1 or run.act_bytes == 4 or expert_fsdp > 1:
        return 0.0
    return run.act_bytes * spec.experts // lay.ep * 3 * spec.expert_ffn_hidden * spec.hidden


def routed_row_bytes(run: RunShape) -> float:
    """What one row received by this rank's experts saves: its input to the experts (under autocast
    its bf16 casts for gate and up), their gate, up, silu and product, and with expert parallelism
    the dispatch's and the combine's int64 row orders."""
    spec = run.spec
    h, fe, mm = spec.hidden, spec.expert_ffn_hidden, run.act_bytes
    orders = 16 if run.layout.ep > 1 else 0
    if run.autocast:
        return 2 * 2 * h + 4 * fe * 2 + orders
    return 4 * fe * mm + mm * h + orders


def _routing(
    run: RunShape, chunks: list[Chunk], rows_per_forward: dict[int, list[int]] | None
) -> dict[tuple[int, int], float]:
    """(stage, micro-batch) -> bytes the routing the run measured adds to the balanced count, over
    the chunk's MoE layers that keep their activations (`rows_per_forward[layer][micro-batch]` rows
    received); empty without expert parallelism or a measurement."""
    if run.layout.ep == 1 or not rows_per_forward:
        return {}
    balanced = run.spec.experts_per_token * run.tokens
    per_row = routed_row_bytes(run)
    logs = {int(layer): rows for layer, rows in rows_per_forward.items()}
    return {
        (c.stage, mb): sum(
            (logs[i][mb] - balanced) * per_row for i in c.layers if i in logs and mb < len(logs[i])
        )
        for c in chunks
        for mb in range(run.microbatches)
    }


def micro_batch_saved(run: RunShape, chunk: Chunk, ids: bool = True) -> float:
    """Saved bytes of one micro-batch on `chunk`; `ids`: with its token ids (a pipeline counts them
    once a step: `planned_activations`)."""
    spec = run.spec
    again = set(run.again([chunk]))
    total = sum(layer_saved(run, spec.is_moe_layer(i), i in again) for i in chunk.layers)
    whole = any(i not in again for i in chunk.layers)
    total += ends_saved(run, chunk, whole)
    if chunk.first and ids:  # the token ids (each block's input, the first's too, is its block's)
        total += 8 * run.tokens
    if chunk.last and ids:  # and the targets the loss keeps
        total += 8 * run.tokens
    return total


def ends_saved(run: RunShape, chunk: Chunk, whole: bool) -> float:
    """What one micro-batch saves on `chunk` beside its blocks, without the step's token ids and
    targets: the rotary table where a block runs whole (`whole`), and on the last chunk the final
    norm, the head's input and the loss."""
    spec, lay = run.spec, run.layout
    t, h = run.tokens, spec.hidden
    n = t // lay.tp if lay.sp else t
    total = 4.0 * t * spec.head_dim if whole else 0.0  # the rotary table: t·d/2 complex64 rotations
    if chunk.last:  # final norm (its input: the last block's output; with bf16 weights its fp32
        # copy), the head's input (and autocast's weight copy), fp32 log-softmax
        bf16_weights = run.act_bytes == 2 and not run.autocast
        total += 4 * n + 4 * n * h + (2 * n * h if bf16_weights else n * h * run.stream_bytes)
        total += _linear_inputs(run, t, h, 1) + _weights(run, spec.vocab * h / lay.tp)
        total += loss_saved(run, chunk, ids=False)
    return total


def block_saved(
    spec: ModelSpec, layout: Layout, micro_batch: int, seq_len: int, dtype: str, moe: bool, recompute: str
) -> float:
    """`layer_saved` of one block under `recompute` ("full": the block re-runs whole, keeping its
    input; "selective": its attention core re-runs; "none"), whatever the layout's own recompute:
    the layout plan weighs each kind (`fivefold.plan.memory`)."""
    kind = "selective" if recompute == "selective" else "none"
    run = RunShape(spec, dataclasses.replace(layout, recompute=kind), micro_batch, seq_len, 1, dtype)
    return layer_saved(run, moe, recomputed=recompute == "full")


def loss_saved(run: RunShape, chunk: Chunk, ids: bool = True) -> float:
    """What the loss itself saves on the last chunk (the fp32 log-softmax over the vocabulary shard,
    the targets, the count): the one part of a micro-batch a split backward's input pass frees,
    since it detaches the loss; every node below it waits for the weight pass."""
    if not chunk.last:
        return 0.0
    t = run.tokens
    return 4 * t * run.spec.vocab // run.layout.tp + (8 * t if ids else 0) + 4


def planned_activations(
    spec: ModelSpec,
    layout: Layout,
    micro_batch: int,
    seq_len: int,
    microbatches: int,
    dtype: str,
    coords: dict[str, int],
    rows_per_forward: dict[int, list[int]] | None = None,
) -> float:
    """Peak saved bytes on the rank at `coords`: one micro-batch without pipelining (its backward
    frees it before the next forward), the micro-batches in flight on this stage with it. With
    expert parallelism, `rows_per_forward` (layer -> rows its experts received in each micro-batch's
    forward, as the run measured them) puts each micro-batch's own routing in place of the balanced
    count; without it every rank is planned as receiving the rows it sends."""
    run = RunShape(spec, layout, micro_batch, seq_len, microbatches, dtype)
    chunks = run.chunks(coords.get("pp", 0))
    per = [micro_batch_saved(run, c, ids=False) for c in chunks]
    routing = _routing(run, chunks, rows_per_forward)
    # each micro-batch is a view of one tensor of the step's token ids (the rank's batch, or the one
    # the pipeline splits), and of its targets: the embedding's saved ids and the loss's saved
    # targets hold those whole storages, from the first forward to the last backward
    ends = sum(c.first for c in chunks) + sum(c.last for c in chunks)
    ids = 8 * run.tokens * microbatches * ends
    if layout.pp == 1:  # with cp, each micro-batch's sequence shard is a copy of its own instead
        worst = max(routing.values(), default=0.0)  # the micro-batch whose routing saves the most
        return per[0] + worst + (ids // microbatches if layout.cp > 1 else ids)
    # interleaved chunks and split backwards, or each micro-batch's own routing: what each chunk holds
    # as the schedule's own table runs
    if layout.pp_schedule in TABLED or routing:
        saved = {c.stage: b for c, b in zip(chunks, per)}
        loss = {c.stage: input_pass_frees(run, c) for c in chunks}
        return ids + schedule_peak(layout, coords.get("pp", 0), microbatches, saved, loss, routing)
    flight = in_flight(layout, coords.get("pp", 0), microbatches)
    return ids + sum(p * f for p, f in zip(per, flight))


# schedules whose peak is read off their action table (the rest: `in_flight`'s closed forms)
TABLED = ("interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")


def schedule_peak(
    layout: Layout,
    pp_rank: int,
    m: int,
    saved: dict[int, float],
    loss: dict[int, float] | None = None,
    extra: dict[tuple[int, int], float] | None = None,
) -> float:
    """The peak of what the rank holds as it runs its schedule's own action table (torch's schedule
    class, replayed as `fivefold.measure.bubble` does): a chunk's forward (F) saves its micro-batch's
    tensors and its whole backward (B) releases them. A split backward's input pass (I) retains the
    graph for the weight pass (W) and frees only what no weight's gradient needs (`loss`: the last
    chunk's loss, a middle chunk's MoE tail, `input_pass_frees`); W frees the rest.
    `extra[(stage, micro-batch)]`: what that micro-batch holds beyond `saved` (its routing)."""
    from fivefold.measure.bubble import action_table  # torch's table: verify runs with torch

    loss, extra = loss or {}, extra or {}
    table, _ = action_table(layout.pp_schedule, layout.pp, m, layout.virtual_stages)
    held = peak = 0.0
    for stage, kind, mb in table[pp_rank]:
        part = loss.get(stage, 0.0)
        whole = saved[stage] + extra.get((stage, mb), 0.0)
        held += {"F": whole, "B": -whole, "I": -part, "W": part - whole}[kind]
        peak = max(peak, held)
    return peak


def in_flight(layout: Layout, pp_rank: int, m: int) -> list[float]:
    """Micro-batches each of the rank's chunks holds at the rank's peak (1F1B: pp - rank warm-up
    forwards; GPipe: all of them)."""
    from fivefold.layout_math import rank_stages

    chunks = rank_stages(pp_rank, layout.pp, layout.virtual_stages, layout.pp_schedule)
    if layout.pp_schedule == "gpipe":
        return [float(m)] * len(chunks)
    stages = layout.pp * layout.virtual_stages
    return [float(min(m, stages - s)) for s in chunks]
