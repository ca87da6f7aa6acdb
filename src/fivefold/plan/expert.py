"""Expert-parallel traffic of one step on one rank (fivefold.parallel.expert's dispatch).

Per MoE layer and micro-batch: an all_to_all of the per-expert row counts (int64), the rows to
their experts' ranks and the results back (there: the rows this rank routes, b·s·top-k; back: the
rows its experts received), and in backward the reverse two. Full recompute dispatches again.
Balanced routing receives as many rows as it sends; `received` gives the run's actual count (all
dispatches of the step, recomputed ones included, as `GroupedExperts.rows_received` counts them).
With fsdp, each MoE layer's experts are an FSDP unit of their own over `expert_fsdp` (gathered in
the compute dtype as often as the model's units, gradients reduce-scattered in fp32 once a step),
then each gradient shard is all_reduce'd over `dp`; without fsdp each expert gradient is
all_reduce'd over `expert_fsdp`, then `dp`.
"""

from __future__ import annotations

from fivefold.layout_math import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, padded
from fivefold.plan.runshape import Chunk, RunShape, Traffic


def expert_weights(run: RunShape) -> int:
    """Elements of one MoE layer's experts held on one rank (E/ep of them)."""
    spec = run.spec
    return spec.experts // run.layout.ep * 3 * spec.expert_ffn_hidden * spec.hidden


def rows_sent(run: RunShape, chunks: list[Chunk]) -> int:
    """Rows this rank dispatches in one step's forwards (each token to its top-k experts)."""
    moe = sum(run.spec.is_moe_layer(i) for c in chunks for i in c.layers)
    return run.microbatches * moe * run.tokens * run.spec.experts_per_token


def expert_traffic(
    run: RunShape, chunks: list[Chunk], received: int | None = None, received_once: int | None = None
) -> Traffic:
    lay, spec = run.layout, run.spec
    out = Traffic()
    moe = sum(spec.is_moe_layer(i) for c in chunks for i in c.layers)
    if lay.ep == 1 or not moe:
        return out
    passes = moe + sum(spec.is_moe_layer(i) for i in run.again(chunks))  # MoE forwards, recomputed too
    sent = rows_sent(run, chunks)  # one forward of every MoE layer; the backward sends as many
    sent_fwd = sent * passes // moe
    got_fwd = sent_fwd if received is None else received
    # rows whose gradients go back: a forward's, recomputed ones once (a share when not measured)
    got = received_once if received_once is not None else got_fwd * moe // passes
    m = run.microbatches
    # rows go out in the MoE input's dtype (the fp32 norm output under autocast) and come back
    # in the experts' output dtype; each gradient travels in its tensor's dtype the other way
    d_in, d_out = spec.hidden * run.stream_bytes, spec.hidden * run.act_bytes
    out.add("ep", ALL_TO_ALL, m * (3 * passes + 2 * moe), 0)
    out.rows[("ep", ALL_TO_ALL)][1] += m * passes * spec.experts * 8  # the counts
    out.rows[("ep", ALL_TO_ALL)][1] += sent_fwd * d_in + got_fwd * d_out + sent * d_out + got * d_in
    expert_fsdp = lay.fsdp * lay.cp // lay.ep
    if lay.fsdp > 1 and expert_fsdp > 1:  # fivefold.parallel.expert.shard_experts
        from fivefold.plan.dataparallel import fsdp_gathers

        h, fe, local = spec.hidden, spec.expert_ffn_hidden, spec.experts // lay.ep
        full = 3 * padded((local, fe, h), expert_fsdp)
        syncs = run.fsdp_syncs
        out.add("expert_fsdp", ALL_GATHER, fsdp_gathers(run) * moe, full * run.act_bytes)
        out.add("expert_fsdp", REDUCE_SCATTER, syncs * moe, full * 4)
        if lay.dp > 1:
            out.add("dp", ALL_REDUCE, syncs * 3 * moe, full // 3 // expert_fsdp * 4)
        return out
    for axis, size in (("expert_fsdp", expert_fsdp), ("dp", lay.dp)):
        if size > 1:
            out.add(axis, ALL_REDUCE, 3 * moe, expert_weights(run) // 3 * 4)
    return out
