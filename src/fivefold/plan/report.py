"""`plan()`: memory, communication, bubble, step time and MFU of one layout, as a `Plan`.

Step time of the busiest pipeline stage:
    step = m·(t_f + t_b) + bubble + exposed pipeline transfers + exposed data-parallel traffic + optimizer
where t_f, t_b are one micro-batch's forward and backward (recompute included) through the stage,
with the tensor-, context- and expert-parallel collectives that sit on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.flops import hardware_flops_per_token, model_flops_per_token
from fivefold.layout_math import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    REDUCE_SCATTER,
    SEND,
    end_ranks,
    interleaved_needs_chunks,
    names_by_layer,
)
from fivefold.plan.comm import (
    Collective,
    collective_time,
    ep_link,
    ep_members_per_node,
    host_dispatch,
    in_ledger_words,
    links,
    ring_nics,
)
from fivefold.plan.compute import (
    HOST_LINK_BPS,
    LayerTime,
    Rates,
    accumulate_pass_time,
    head_time,
    host_threads_of,
    layer_time,
    on_this_host,
    optimizer_time,
)
from fivefold.plan.dataparallel import data_parallel_traffic, gather_copies_time
from fivefold.plan.memory import (
    BYTES,
    Memory,
    cached_stage_params,
    chunk_layers,
    eager_count,
    expert_rows,
    holds_embedding,
    holds_head,
    layer_activations,
    memory,
    recomputed_counts,
    recomputed_fraction,
    runs_own_tensors,
    shard_group,
    stage_counts,
    stage_rank,
    stage_weights,
)
from fivefold.plan.pipeline import bubble_time, p2p_on_critical_path
from fivefold.plan.result import Plan, capacity
from fivefold.plan.runshape import fsdp_sync_deferred
from fivefold.plan.spec import (
    GPT_GUESS_NOTE,
    Arch,
    TrainShape,
    block_modules,
    gpt_block_guessed,
    kv_heads_local,
    matmul_params,
    resolve_arch,
    total_params,
)


def check_plan_inputs(model: ModelSpec, layout: Layout, shape: TrainShape) -> None:
    """What the model allows (a plan may predict layouts other frameworks run, e.g. ZeRO-1 with tp);
    the search also applies `check_trainable`, so it proposes only what `train` runs."""
    layout.check_model(model, shape.seq_len, even_sp=not shape.sp_any_length)
    if layout.pp > 1 and layout.pp_schedule == "interleaved-1f1b" and layout.virtual_stages < 2:
        raise interleaved_needs_chunks(model.layers, layout.pp)


def plan(
    model: ModelSpec, hw: HardwareSpec, layout: Layout, shape: TrainShape, gpus_per_node: int | None = None
) -> Plan:
    """Predict one training step of `model` on `hw` with a resolved `layout`."""
    shape.validate()
    check_plan_inputs(model, layout, shape)
    gpn = gpus_per_node or hw.gpus_per_node
    shape = shape.on(hw)
    hw = on_this_host(hw, layout.world, gpn)
    arch = resolve_arch(model, shape.block, shape.attention, shape.expert_tp)
    m = shape.microbatches(layout)
    return _plan(model, hw, layout, shape, arch, gpn, m)


@dataclass(frozen=True)
class ModelFacts:
    """Per-model numbers every layout shares (computed once per search)."""

    params: int
    model_flops: float  # per token, full attention square
    causal_flops: float  # per token, causal half of attention
    hardware_flops: dict[str, float]  # per token, by recompute


_FACTS: dict[tuple, ModelFacts] = {}


def model_facts(model: ModelSpec, arch: Arch, seq_len: int) -> ModelFacts:
    """The model's counts, kept per (model, arch, sequence): every plan of a search or of the
    explorer's lab asks for the same ones, and counting a deep model's parameters is not free."""
    key = (repr(model), arch, seq_len)  # ModelSpec is mutable, so unhashable; its repr names every field
    if key not in _FACTS:
        if len(_FACTS) > 256:
            _FACTS.clear()
        _FACTS[key] = _model_facts(model, arch, seq_len)
    return _FACTS[key]


def _model_facts(model: ModelSpec, arch: Arch, seq_len: int) -> ModelFacts:
    n = matmul_params(model, arch)
    mflops = model_flops_per_token(model, seq_len, causal=False, matmul_params=n)
    causal = model_flops_per_token(model, seq_len, causal=True, matmul_params=n)
    hw = {
        rc: hardware_flops_per_token(model, seq_len, rc, causal=False, matmul_params=n)
        for rc in ("none", "selective", "full")
    }
    return ModelFacts(total_params(model, arch), mflops, causal, hw)


def layer_times(
    model: ModelSpec, arch: Arch, layout: Layout, shape: TrainShape, rates: Rates, memo: dict
) -> dict[bool, LayerTime]:
    """Dense (False) and MoE (True) layer times, cached in `memo` across layouts."""
    out = {}
    # fivefold's ring and all-gather cores score every key block under a position mask, the
    # blocks above the diagonal too; Ulysses' causal kernel and published rings skip them
    skip = layout.cp == 1 or layout.cp_impl == "ulysses" or shape.cp_causal_skip
    for moe in (False, True) if model.is_moe else (False,):
        key = (
            "time",
            layout.tp,
            layout.cp,
            layout.sp,
            layout.ep,
            shape.micro_batch,
            shape.act_bytes,
            moe,
            skip,
            layout.cp_impl if layout.cp > 1 else "",  # Ulysses' layout copies
        )
        if key not in memo:
            memo[key] = layer_time(
                model, arch, layout, shape.micro_batch, shape.seq_len, rates, moe, shape.fused, skip
            )
        out[moe] = memo[key]
    return out


def sub_module_facts(
    model: ModelSpec, arch: Arch, layout: Layout, shape: TrainShape
) -> tuple[list[float] | None, float]:
    """What `data_parallel_traffic` needs where ZeRO-3 gathers sub-modules under a live-parameter
    bound (DeepSpeed): the block's sub-modules and the share of blocks full recompute re-runs; (None,
    0) elsewhere, which keeps the work off every other plan."""
    if layout.zero != 3 or shape.live_params <= 0:
        return None, 0.0
    return block_modules(model, arch, layout), recomputed_fraction(model, layout, shape.seq_len)


def fsdp_units(model: ModelSpec, layout: Layout, which: str, seq_len: int = 0) -> int:
    """FSDP units a rank of this stage gathers one at a time (as fivefold.parallel.data wraps them):
    each block, the embedding, and the final norm with the head (with the embedding when tied)."""
    n_dense, n_moe = stage_counts(model, layout.pp, which, layout, seq_len)
    first, last = holds_embedding(which), holds_head(which)
    return n_dense + n_moe + int(first) + int(last and not (model.tie_embeddings and first))


def _selective_frees(model: ModelSpec, layout: Layout, shape: TrainShape) -> list[str]:
    """A note where selective recompute frees (almost) nothing of fivefold's eager blocks: its SDPA
    core saves only q, k, v, its output and the log-sum-exp, which the checkpoint keeps at its
    boundary anyway (q and k in the fp32 stream under autocast: then it keeps more)."""
    from fivefold.plan.activations import block_saved

    moe = model.is_moe_layer(model.layers - 1)  # the blocks most of the model is made of
    kept = {
        rc: block_saved(model, layout, shape.micro_batch, shape.seq_len, shape.dtype, moe, rc)
        for rc in ("none", "selective")
    }
    freed = 1 - kept["selective"] / kept["none"] if kept["none"] else 0.0
    if freed >= 0.05:
        return []
    said = f"frees {freed:.1%} of" if freed > 0 else f"keeps {-freed:.1%} more of"
    return [
        f"--recompute selective {said} a block's saved activations here: the attention core it re-runs "
        "saves little beside its inputs; --recompute full (or --recompute-layers N) frees memory"
    ]


def stage_tensors(model: ModelSpec, layout: Layout, shape: TrainShape, which: str) -> int:
    """Parameter tensors a stage holds: its blocks' (fivefold's runtime: each block's own, an MoE
    block's router, stacked experts and shared expert with them; another trainer's:
    `TrainShape.block_tensors` each), the embedding on the first stage, the final norm and the head
    on the last (a tied head is the embedding's tensor where one stage holds both)."""
    tied = model.tie_embeddings and holds_embedding(which)
    if shape.zero1_broadcasts:  # fivefold's runtime, whose parameter list the exact step reads
        by_layer = names_by_layer(model)
        rank = stage_rank(which, layout.pp)
        blocks = sum(len(by_layer[i]) for r in chunk_layers(model, layout, shape.seq_len, rank) for i in r)
    else:
        blocks = sum(stage_counts(model, layout.pp, which, layout, shape.seq_len)) * shape.block_tensors
    return blocks + int(holds_embedding(which)) + (2 - int(tied)) * int(holds_head(which))


def _forward(lt: dict[bool, LayerTime], dense: int, moe: int) -> float:
    """Forward seconds of `dense` dense and `moe` MoE layers (one micro-batch, one rank)."""
    return dense * lt[False].fwd + (moe * lt[True].fwd if moe else 0.0)


def step_lower_bound(
    model: ModelSpec, arch: Arch, hw: HardwareSpec, layout: Layout, shape: TrainShape, m: int, memo: dict
) -> float:
    """Step time with every collective free: never above `_plan`'s (the search's pruning bound)."""
    rates = Rates.of(hw, shape.fp8, shape.attention, shape.act_bytes)
    lt = layer_times(model, arch, layout, shape, rates, memo)
    weights = stage_weights(layout, model, shape.seq_len)
    times = []
    for which in weights:
        n_dense, n_moe = stage_counts(model, layout.pp, which, layout, shape.seq_len)
        mix = [(n_dense, lt[False])] + ([(n_moe, lt[True])] if n_moe else [])
        f = _forward(lt, n_dense, n_moe)
        b = sum(c * x.bwd for c, x in mix)
        b += _forward(lt, *recomputed_counts(model, layout, which, shape.seq_len))
        if layout.recompute == "selective":
            b += sum(c * x.redo(shape.sac) for c, x in mix)
        if holds_head(which):
            key = ("head", layout.tp, layout.cp, shape.micro_batch)
            if key not in memo:
                memo[key] = head_time(model, layout, shape.micro_batch, shape.seq_len, rates)
            hf, hb = memo[key]
            f, b = f + hf, b + hb
        times.append((f, b, weights[which]))
    worst = max(f + b for f, b, _ in times)
    ranks = sum(w for *_, w in times)
    mean_f = sum(f * w for f, _, w in times) / ranks
    mean_b = sum(b * w for _, b, w in times) / ranks
    bubble = bubble_time(layout.pp_schedule, layout.pp, m, layout.virtual_stages, mean_f, mean_b)
    return m * worst + bubble


def _plan(
    model: ModelSpec,
    hw: HardwareSpec,
    layout: Layout,
    shape: TrainShape,
    arch: Arch,
    gpn: int,
    m: int,
    mem: Memory | None = None,
    facts: ModelFacts | None = None,
    memo: dict | None = None,
) -> Plan:
    memo = {} if memo is None else memo
    rates = Rates.of(hw, shape.fp8, shape.attention, shape.act_bytes)
    kinds = links(layout, gpn)
    mem = mem or memory(model, arch, layout, shape, m, memo)
    comms: dict[tuple[str, str], Collective] = {}

    def add(
        axis: str,
        op: str,
        payload: float,
        n: int,
        link: str,
        count: float,
        exposed: float = -1.0,
        overlap: str = "none",
        per_node: int = 1,
    ) -> float:
        """Record `count` collectives of `payload` bytes; return their time (all counted as exposed
        unless `exposed` says otherwise)."""
        if n <= 1 or count <= 0:
            return 0.0
        wire, t = collective_time(hw, op, payload, n, link, per_node, axis)
        key = (axis, op)
        c = comms.get(key) or Collective(axis, op, 0.0, 0.0, 0.0, link, 0, n, overlap=overlap)
        c.bytes += payload * count
        c.wire_bytes += wire * count
        c.time_s += t * count
        c.count += int(round(count))
        c.exposed_s += t * count if exposed < 0 else exposed
        comms[key] = c
        return t

    tokens = shape.micro_batch * shape.seq_len / layout.cp
    act_bytes = shape.act_bytes * tokens * model.hidden
    tp_link, cp_link = kinds.get("tp", "intra"), kinds.get("cp", "intra")
    exp_link = ep_link(layout, gpn)
    rc = layout.recompute
    lt = layer_times(model, arch, layout, shape, rates, memo)
    # a tp or cp group spanning nodes stripes its rings over the NICs of its members on each node, as
    # the data-parallel groups do; point-to-point and all-to-all traffic goes through one NIC a rank
    striped = {a: ring_nics(layout, (a,), kinds.get(a, "intra"), gpn) for a in ("tp", "cp")}
    # an all-to-all's members on each node exchange their share over NVLink
    local = {"cp": striped["cp"], "ep": ep_members_per_node(layout, gpn)}

    def nics(axis: str, op: str) -> int:
        if op == ALL_TO_ALL:
            return local.get(axis, 1)
        return striped.get(axis, 1) if op in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE) else 1

    def t_of(op: str, payload: float, group: int, link: str, axis: str = "") -> float:
        return collective_time(hw, op, payload, group, link, nics(axis, op), axis)[1]

    def stage_costs(which: str) -> tuple[float, float, float, float, list[tuple], tuple[float, float]]:
        """(t_f, t_b, compute, exposed comm) of one micro-batch through a stage, its collectives as
        (axis, op, payload, group, link, calls, exposed seconds, overlap), and one layer's (fwd, bwd)."""
        n_dense, n_moe = stage_counts(model, layout.pp, which, layout, shape.seq_len)
        n = n_dense + n_moe
        per = max(n, 1)  # per-layer shares; a first or last stage may hold no layer (`--pp-split 0,32`)
        # full recompute runs the forward of its blocks (and their collectives) twice
        r_dense, r_moe = recomputed_counts(model, layout, which, shape.seq_len)
        r = r_dense + r_moe
        again = r / per  # the share of the stage's per-layer forward collectives run again
        mix = [(n_dense, lt[False])] + ([(n_moe, lt[True])] if n_moe else [])
        f = _forward(lt, n_dense, n_moe)
        f_again = _forward(lt, r_dense, r_moe)
        b = sum(c * x.bwd for c, x in mix)
        core = sum(c * x.redo(shape.sac) for c, x in mix)
        wgrad = sum(c * x.wgrad for c, x in mix)
        recs: list[tuple] = []
        exp_f = exp_b = 0.0
        not_again = 0.0  # forward collective seconds that a full recompute does not run again
        if layout.tp > 1:  # two collectives per layer and pass: all-reduce, or all-gather + reduce-scatter
            ops = (ALL_GATHER, REDUCE_SCATTER) if layout.sp else (ALL_REDUCE,)
            times = {op: t_of(op, act_bytes, layout.tp, tp_link, "tp") for op in ops}
            # collectives of each op a pass: two a layer, but an MoE block whole on every tp rank
            # (fivefold's) sums nothing: its output is the same on each rank, and under sp it only
            # gathers its input (its output shard is a slice)
            per_pass = {op: 2.0 * n for op in ops}
            if not arch.expert_tp:
                for op in set(ops) & {ALL_REDUCE, REDUCE_SCATTER}:
                    per_pass[op] -= n_moe
            t_pass = sum(per_pass[op] * times[op] for op in ops)
            # backward: each input-gradient collective overlaps the weight-gradient matmul; with
            # collective matmuls (TE userbuffers, torch async TP) the forward ones hide behind the
            # matmul they feed, and the backward ones behind both backward matmuls
            over = shape.tp_overlap
            hidden_f = min(t_pass, wgrad) if over else 0.0
            beside_wgrad = over or shape.tp_backward_overlap
            hidden_b = min(t_pass, (2 if over else 1) * wgrad) if hw.comm_overlap and beside_wgrad else 0.0
            if over and not shape.tp_overlap_backward_scatters:  # torch's micro-pipelined TP: only the
                # output-gradient gathers hide, behind the input-gradient matmuls they feed
                gathers = 2 * n * times.get(ALL_GATHER, 0.0)
                hidden_b = min(gathers, wgrad) if hw.comm_overlap else 0.0
            exp_f += t_pass - hidden_f
            exp_b += t_pass - hidden_b
            for op in ops:
                share = per_pass[op] * times[op] / t_pass if t_pass else 0.0
                # full recompute re-runs a block's forward collectives; torch's checkpoint (DTensor
                # trainers) stops once the saved tensors are rebuilt, before the block's last one
                again_calls = 2 * r if shape.tp_regather or op == ALL_GATHER else r
                again_calls = round(again_calls * per_pass[op] / (2 * n)) if n else again_calls
                calls = round(2 * per_pass[op]) + again_calls
                again_op = again * again_calls / (2 * r) if r else 0.0
                not_again += share * (t_pass - hidden_f) * (again - again_op)
                recs.append(
                    (
                        "tp",
                        op,
                        act_bytes,
                        layout.tp,
                        tp_link,
                        calls,
                        share * ((1 + again_op) * (t_pass - hidden_f) + t_pass - hidden_b),
                        "matmuls (collective matmul)" if over else "weight-grad matmuls",
                    )
                )
            if layout.sp and shape.tp_regather:  # inputs kept sharded: gathered again for the wgrads
                t_ag = 0.0 if over else 2 * n * times[ALL_GATHER]
                exp_b += t_ag
                recs.append(("tp", ALL_GATHER, act_bytes, layout.tp, tp_link, 2 * n, t_ag, "none"))
        if layout.cp > 1:
            c = layout.cp
            kv_local = kv_heads_local(model, layout.tp) * model.head_dim
            if layout.cp_impl == "ring":  # K,V blocks pass around the ring behind each block's attention
                block = 2 * shape.act_bytes * tokens * kv_local
                # backward: the blocks go round again with their gradient buffer, which takes one
                # hop more, home (fp32 in fivefold's ring)
                grad_block = 2 * (4 if shape.ring_grad_fp32 else shape.act_bytes) * tokens * kv_local
                t_block, t_grad = t_of(SEND, block, 2, cp_link), t_of(SEND, grad_block, 2, cp_link)
                step_f = (c - 1) * t_block
                step_b = (c - 1) * t_block + c * t_grad
                beside = 1.0 if hw.comm_overlap else 0.0  # on a CPU the ring's sends wait for the compute
                e_f = n * max(step_f - beside * core / per, 0.0)
                e_b = n * max(step_b - 2 * beside * core / per, 0.0)
                exp_f += e_f
                exp_b += e_b
                hops: dict[float, float] = {}  # hops by bytes: one entry where both are the same size
                for size, count in ((block, (c - 1) * (2 * n + r)), (grad_block, c * n)):
                    hops[size] = hops.get(size, 0) + count
                hop_time = {block: t_block, grad_block: t_grad}
                sent = sum(count * hop_time[size] for size, count in hops.items())
                for size, count in hops.items():
                    share = count * hop_time[size] / sent
                    recs.append(
                        (
                            "cp",
                            SEND,
                            size,
                            c,
                            cp_link,
                            count,
                            share * ((1 + again) * e_f + e_b),
                            "attention blocks",
                        )
                    )
            elif layout.cp_impl == "allgather":  # K and V gathered forward, their grads reduce-scattered
                each = shape.act_bytes * shape.seq_len * shape.micro_batch * kv_local  # K or V, gathered
                t_ag = 2 * n * t_of(ALL_GATHER, each, c, cp_link, "cp")
                t_rs = 2 * n * t_of(REDUCE_SCATTER, each, c, cp_link, "cp")
                exp_f += t_ag
                exp_b += t_rs
                recs.append(("cp", ALL_GATHER, each, c, cp_link, 2 * (n + r), (1 + again) * t_ag, "none"))
                recs.append(("cp", REDUCE_SCATTER, each, c, cp_link, 2 * n, t_rs, "none"))
            else:  # Ulysses: q, k, v in and the output back, all-to-all over heads
                payload = shape.act_bytes * tokens * (model.heads * model.head_dim / layout.tp + kv_local) / 2
                t4 = 4 * n * t_of(ALL_TO_ALL, payload, c, cp_link, "cp")
                exp_f += t4
                exp_b += t4
                recs.append(
                    ("cp", ALL_TO_ALL, payload, c, cp_link, 4 * (2 * n + r), (2 + again) * t4, "none")
                )
        if layout.ep > 1 and n_moe:  # dispatch and combine, forward and backward
            # fivefold: every tp rank dispatches all its tokens (the MoE block is whole on each);
            # expert tensor parallelism (published runs): the tp ranks split them
            etp = layout.tp if arch.expert_tp else 1
            payload = shape.act_bytes * tokens * model.experts_per_token * model.hidden / etp
            t2 = 2 * n_moe * t_of(ALL_TO_ALL, payload, layout.ep, exp_link, "ep")
            hidden = layout.pp_schedule == "dualpipev" and layout.pp > 1  # overlapped with the paired chunk
            if hidden:  # a forward chunk's all-to-alls run under another micro-batch's backward and the
                # backward's under a forward: each hides at most the compute of the chunk it is paired with
                e2_f, e2_b = max(t2 - b, 0.0), max(t2 - f, 0.0)
                exp_f += e2_f
                exp_b += e2_b
            else:
                exp_f += t2
                exp_b += t2
            recs.append(
                (
                    "ep",
                    ALL_TO_ALL,
                    payload,
                    layout.ep,
                    exp_link,
                    2 * (2 * n_moe + r_moe),
                    e2_f * (1 + again) + e2_b if hidden else (2 + r_moe / n_moe) * t2,
                    "paired chunk (DualPipe)" if hidden else "none",
                )
            )
            # before each forward dispatch, the rows each expert will get: one int64 per expert
            t_counts = t_of(ALL_TO_ALL, 8 * model.experts, layout.ep, exp_link, "ep")
            exp_f += n_moe * t_counts
            recs.append(
                (
                    "ep",
                    ALL_TO_ALL,
                    8 * model.experts,
                    layout.ep,
                    exp_link,
                    n_moe + r_moe,
                    (n_moe + r_moe) * t_counts,
                    "none",
                )
            )
        # per layer: one forward pass, its backward, and (full recompute) the forward's collectives again
        exp_rc = exp_f * again - not_again
        layer_f, layer_b = (f + exp_f) / per, (b + exp_b + exp_rc) / per
        if layout.tp > 1:  # the vocab-parallel embedding's output and the head's input
            emb, head = holds_embedding(which), holds_head(which)
            if layout.sp:  # scattered to / gathered from the sequence shards: embedding RS forward and
                # AG backward, head AG forward and RS backward
                t_ag = t_of(ALL_GATHER, act_bytes, layout.tp, tp_link, "tp")
                t_rs = t_of(REDUCE_SCATTER, act_bytes, layout.tp, tp_link, "tp")
                exp_f += emb * t_rs + head * t_ag
                exp_b += emb * t_ag + head * t_rs
                for op, t in ((ALL_GATHER, t_ag), (REDUCE_SCATTER, t_rs)):
                    if emb + head:
                        recs.append(
                            ("tp", op, act_bytes, layout.tp, tp_link, emb + head, t * (emb + head), "none")
                        )
            else:  # embedding all-reduce forward, the head's input gradient backward
                t_ar = t_of(ALL_REDUCE, act_bytes, layout.tp, tp_link, "tp")
                exp_f += t_ar * emb
                exp_b += t_ar * head
                if emb + head:
                    recs.append(
                        (
                            "tp",
                            ALL_REDUCE,
                            act_bytes,
                            layout.tp,
                            tp_link,
                            emb + head,
                            t_ar * (emb + head),
                            "none",
                        )
                    )
            if head:  # the loss over vocabulary shards: max logit, sum of exponentials, target logit
                t_loss = 3 * t_of(ALL_REDUCE, 4 * tokens, layout.tp, tp_link, "tp")
                exp_f += t_loss
                recs.append(("tp", ALL_REDUCE, 4 * tokens, layout.tp, tp_link, 3, t_loss, "none"))
        recompute = f_again if rc == "full" else (core if rc == "selective" else 0.0)
        hf = hb = 0.0
        if holds_head(which):
            hf, hb = head_time(model, layout, shape.micro_batch, shape.seq_len, rates)
        compute = f + b + recompute + hf + hb
        t_f = f + hf + exp_f
        t_b = b + recompute + hb + exp_b + exp_rc  # recomputed forward collectives run in the backward
        layer_b += recompute / per
        return t_f, t_b, compute, exp_f + exp_b + exp_rc, recs, (layer_f, layer_b)

    # every distinct rank of the pipeline: the slowest sets the pace, the bubble is the others' fill
    # and drain (a rank-weighted mean)
    weights = stage_weights(layout, model, shape.seq_len)
    per_stage = {which: stage_costs(which) for which in weights}
    worst = max(per_stage, key=lambda k: per_stage[k][0] + per_stage[k][1])
    t_f, t_b, compute_mb, exposed_mb, recs, (layer_f, layer_b) = per_stage[worst]
    for axis, op, payload, group, link, calls, exposed, overlap in recs:
        add(axis, op, payload, group, link, calls * m, exposed * m, overlap, nics(axis, op))
    ranks = sum(weights.values())
    mean_f = sum(v[0] * weights[k] for k, v in per_stage.items()) / ranks
    mean_b = sum(v[1] * weights[k] for k, v in per_stage.items()) / ranks
    v = layout.virtual_stages
    bubble = bubble_time(layout.pp_schedule, layout.pp, m, v, mean_f, mean_b)
    if layout.pp > 1:  # activations (and their grads) to the next stage
        pp_payload = act_bytes / (layout.tp if layout.sp or shape.pp_scatter else 1)
        pp_link = kinds.get("pp", "inter")
        t_p2p = collective_time(hw, SEND, pp_payload, 2, pp_link)[1]
        on_path = p2p_on_critical_path(layout.pp_schedule, layout.pp, v) * t_p2p
        # the fill and drain cross every stage boundary; with fewer micro-batches than that this rank
        # sends less than the path carries, and the rest is a wait on other ranks' links: bubble
        own = min(on_path, 2 * m * v * t_p2p)
        bubble += on_path - own
        beside = "steady-state compute"
        if shape.p2p_blocking:  # each micro-batch's receive and send, forward and backward, waited on
            own, beside = 4 * m * v * t_p2p, "none (blocking hand-overs)"
        add("pp", SEND, pp_payload, layout.pp, pp_link, 2 * m * v, exposed=own, overlap=beside)
        first, last = end_ranks(layout)
        if model.tie_embeddings and first != last:  # the embedding and its tied head on two pp ranks,
            # which sum the shared weight's gradient after the schedule (fivefold's pipeline runner,
            # Megatron's embedding group)
            shards = layout.fsdp * layout.cp if layout.fsdp > 1 else 1
            tied = model.vocab / layout.tp / shards * model.hidden * shape.grad_bytes
            add("pp", ALL_REDUCE, tied, 2, pp_link, 1)
    tp_once = 0.0  # seconds of the tp reductions of replicated weights' gradients (after each sync, exposed)
    if layout.tp > 1:  # partial weight gradients summed over tp with each gradient sync
        n_layers = sum(stage_counts(model, layout.pp, worst, layout, shape.seq_len))
        # FSDP syncs every micro-batch's gradients (in the weights' dtype) outside a pipeline
        syncs = m if layout.fsdp > 1 and not fsdp_sync_deferred(layout) else 1
        if layout.sp:  # the norms' (replicated weights over sequence shards)
            norms = 2 * n_layers + int(holds_head(worst))
            width = shape.param_bytes if syncs > 1 else shape.grad_bytes
            if shape.tp_regather:  # Megatron: every norm's in one call
                tp_once += syncs * add(
                    "tp", ALL_REDUCE, norms * model.hidden * width, layout.tp, tp_link, syncs
                )
            else:  # DTensor: one per norm weight
                tp_once += (
                    norms
                    * syncs
                    * add("tp", ALL_REDUCE, model.hidden * width, layout.tp, tp_link, norms * syncs)
                )
        # the gradient norm's fp64 sum over the tp-sharded parameters (fivefold's clipping, Megatron's)
        tp_once += add("tp", ALL_REDUCE, 8, layout.tp, tp_link, 1)
        if layout.tp > model.kv_heads and not shape.tp_regather:  # K/V projections replicated over tp
            kv = model.kv_heads * model.head_dim * model.hidden * shape.param_bytes
            calls = 2 * n_layers * syncs  # with each of FSDP's syncs, as the norms'
            tp_once += calls * add("tp", ALL_REDUCE, kv, layout.tp, tp_link, calls)
    pipeline_time = m * (t_f + t_b) + bubble

    # --- data-parallel traffic: gradients, and parameters under ZeRO-1/3
    exact = runs_own_tensors(model, arch, shape)
    dense, experts, _ = cached_stage_params(model, arch, layout, worst, memo, shape.seq_len, exact)
    data_parallel_traffic(
        layout,
        shape,
        m,
        dense,
        experts,
        kinds,
        add,
        t_f,
        t_b,
        hw,
        *sub_module_facts(model, arch, layout, shape),
        units=fsdp_units(model, layout, worst, shape.seq_len),
        tensors=stage_tensors(model, layout, shape, worst),
        expert_units=stage_counts(model, layout.pp, worst, layout, shape.seq_len)[1],
        expert_rows=expert_rows(model, layout),
    )
    n = shard_group(layout)
    local = (dense / n + experts / max(n // layout.ep, 1)) if layout.zero >= 1 else dense + experts
    opt = optimizer_time(local, rates, hw, offload=shape.offload_optimizer, gpus=layout.world)
    besides = outside_layers(model, arch, layout, shape, worst, m, dense + experts, rates)
    opt += sum(besides.values())
    exposed = (
        sum(c.exposed_s for c in comms.values() if c.axis in ("dp", "fsdp", "expert_fsdp", "pp")) + tp_once
    )
    exposed += nic_contention(comms, pipeline_time + exposed + opt)
    step = pipeline_time + exposed + opt

    facts = facts or model_facts(model, arch, shape.seq_len)
    mflops = facts.model_flops
    if rc == "full":  # the recomputed share of the layers' forward on top of the plain step
        flops = facts.hardware_flops
        hflops = flops["none"] + recomputed_fraction(model, layout, shape.seq_len) * (
            flops["full"] - flops["none"]
        )
    else:
        hflops = facts.hardware_flops[rc]
    causal_flops = facts.causal_flops
    gpus = layout.world
    tokens_per_s = shape.global_batch * shape.seq_len / step
    # a CPU rank's peak is its threads' cores (`host_threads_of`): its MFU stays a share of what it has
    peak = hw.peak_tflops * 1e12 * host_threads_of(hw)
    tflops = mflops * tokens_per_s / gpus
    htflops = hflops * tokens_per_s / gpus
    order = ("tp", "cp", "ep", "pp", "fsdp", "fsdp_cp", "expert_fsdp", "dp", "dp_fsdp_cp")
    comm_list = sorted(in_ledger_words(list(comms.values()), layout), key=lambda c: order.index(c.axis))
    notes = []
    if any(besides.values()):
        parts = ", ".join(f"{what} {t:.3f} s" for what, t in besides.items() if t)
        notes.append(f"the optimizer time includes {parts}")
    if layout.pp > 1 and layout.pp_schedule == "interleaved-1f1b" and m % layout.pp:
        notes.append(f"interleaved 1F1B wants micro-batches ({m}) divisible by pp ({layout.pp})")
    if (model.layers % (layout.pp * v)) != 0:
        notes.append(f"{model.layers} layers do not split evenly into pp×virtual = {layout.pp * v} chunks")
    if not hw.comm_overlap and hw.threads_per_rank:  # a CPU device: say what its rates assumed
        notes.append(
            f"each rank computes with {hw.threads_per_rank:g} thread(s) (as `fivefold train` splits this "
            "machine's cores, or as the run recorded); each block's eager ops also cost the host "
            f"{hw.block_dispatch_us:g} µs a forward, whatever the threads"
        )
    if layout.recompute == "selective" and eager_count(model, arch, shape):
        notes += _selective_frees(model, layout, shape)
    if shape.fp32_weights and gpt_block_guessed(model, arch, shape.block):  # fivefold's runtime
        notes.append(GPT_GUESS_NOTE.format(command="train"))
    dispatched = sorted({c.axis for c in comm_list if host_dispatch(hw, c.axis, c.op) > 0}, key=order.index)
    if dispatched:
        each = ", ".join(f"{a} {host_dispatch(hw, a, ALL_GATHER) * 1e3:.2f} ms" for a in dispatched)
        notes.append(
            f"each collective's time includes its host dispatch ({each}: DTensor, FSDP's hooks or the "
            "cp core's functional collectives, which this device's host runs in series with the compute)"
        )
    return Plan(
        model=model,
        hardware=hw,
        layout=layout,
        shape=shape,
        arch=arch,
        gpus_per_node=gpn,
        microbatches=m,
        memory=mem,
        fits=mem.total <= capacity(hw),
        comm=comm_list,
        compute_time_s=m * compute_mb,
        bubble_time_s=bubble,
        bubble_fraction=bubble / pipeline_time if pipeline_time else 0.0,
        exposed_comm_s=exposed + m * exposed_mb,
        optimizer_time_s=opt,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        tflops_per_gpu=tflops / 1e12,
        mfu=tflops / peak,
        hardware_tflops_per_gpu=htflops / 1e12,
        hfu=htflops / peak,
        model_flops_per_token=mflops,
        hardware_flops_per_token=hflops,
        mfu_causal=causal_flops * tokens_per_s / gpus / peak,
        params=facts.params,
        stage_times={
            "forward_s": t_f,
            "backward_s": t_b,
            "pipeline_s": pipeline_time,
            "stage": worst,
            "layer_forward_s": layer_f,
            "layer_backward_s": layer_b,
        },
        notes=notes,
    )


def nic_contention(comms: dict[tuple[str, str], Collective], step: float) -> float:
    """Seconds a step waits on its NIC beyond `step`: every collective that leaves the node goes
    through the rank's NIC(s), one after another, so a step lasts at least their summed time, whatever
    compute windows each hid behind on its own. The wait is charged to those collectives in proportion
    to what they hid."""
    off_node = [c for c in comms.values() if c.link == "inter"]
    short = sum(c.time_s for c in off_node) - step
    hidden = sum(c.time_s - c.exposed_s for c in off_node)
    if short <= 0 or hidden <= 0:
        return 0.0
    short = min(short, hidden)
    for c in off_node:
        c.exposed_s += short * (c.time_s - c.exposed_s) / hidden
    return short


def outside_layers(
    model: ModelSpec,
    arch: Arch,
    layout: Layout,
    shape: TrainShape,
    worst: str,
    m: int,
    params: float,
    rates: Rates,
) -> dict[str, float]:
    """Seconds of a trainer's work outside the layers, in series with the step, by what it is: a
    separate fp32 accumulation pass, checkpoints copied to the host and back, a sharded optimizer's
    gather copied tensor by tensor (`params`: the stage's parameters on this rank)."""
    out: dict[str, float] = {}
    if shape.fp32_accumulate_pass:
        out["the separate fp32 gradient accumulation"] = accumulate_pass_time(params, m, rates)
    if shape.offload_checkpoints:  # each checkpointed layer input to the host and back, in series
        # (DeepSpeed's cpu_checkpointing copies synchronously: its transfer stream is unused)
        kept = (  # a checkpointed layer's input, as the memory plan counts it (16-bit units, rescaled)
            layer_activations(model, arch, layout, shape.micro_batch, shape.seq_len, False, "full")
            * shape.act_bytes
            / BYTES
        )
        copies = 2 * m * sum(recomputed_counts(model, layout, worst, shape.seq_len)) * kept / HOST_LINK_BPS
        out["the checkpoints' copies to the host and back"] = copies
    if shape.sharded_copies:
        gather = gather_copies_time(layout, shape, stage_tensors(model, layout, shape, worst))
        out["the host's per-tensor copies of the sharded optimizer's gather"] = gather
    return out
