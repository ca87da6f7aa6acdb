"""Context-parallel traffic of one step on one rank (fivefold.parallel.context's three cores).

Per layer and micro-batch, with s/cp local tokens, KV heads k and query heads q on this rank:
  * ring: the stacked K,V block hops cp-1 times forward; backward it hops cp-1 times again and a
    fp32 buffer of its gradient hops cp times (the last hop takes it home): send and recv each.
  * allgather: K and V all_gather'ed forward (the whole sequence), their gradients reduce_scatter'ed.
  * ulysses: q, k, v all_to_all'ed to [whole sequence, heads/cp] and the output back, forward; the
    same four the other way backward (K/V heads repeated to q heads when they do not split by cp).
Recompute (selective or full) runs the attention core's forward, and so its traffic, again.
MoE layers all_reduce per-sequence router statistics (counts and probability sums, fp32) forward
and backward for the whole-sequence auxiliary loss (and again forward under full recompute).
"""

from __future__ import annotations

from fivefold.layout_math import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, RECV, REDUCE_SCATTER, SEND
from fivefold.plan.runshape import Chunk, RunShape, Traffic


def local_kv_heads(run: RunShape) -> int:
    spec, tp = run.spec, run.layout.tp
    return spec.kv_heads // tp if tp <= spec.kv_heads else 1  # tp > kv heads: one head kept per rank


def context_traffic(run: RunShape, chunks: list[Chunk]) -> Traffic:
    lay, spec = run.layout, run.spec
    out = Traffic()
    cp = lay.cp
    if cp == 1:
        return out
    m, mb, d = run.microbatches, run.micro_batch, spec.head_dim
    mm, rope = run.act_bytes, run.stream_bytes  # v and outputs; q, k after rotary (fp32 under autocast)
    local = run.seq_len // cp
    heads, kv = spec.heads // lay.tp, local_kv_heads(run)
    layers = sum(len(c.layers) for c in chunks)
    full_again = run.again(chunks)  # blocks full recompute runs again
    # the core's forward runs again in every layer under selective recompute, in the recomputed
    # blocks under full
    again = m * (layers if lay.recompute == "selective" else len(full_again))
    calls = m * layers
    if lay.cp_impl == "ring":
        block = 2 * mb * kv * local * d
        for op in (SEND, RECV):
            out.add("cp", op, (2 * calls + again) * (cp - 1), block * rope)  # K,V stacked: promoted
            out.add("cp", op, calls * cp, block * 4)  # the fp32 gradient buffer
    elif lay.cp_impl == "allgather":
        gathered = mb * kv * run.seq_len * d
        out.add("cp", ALL_GATHER, calls + again, gathered * rope)
        out.add("cp", ALL_GATHER, calls + again, gathered * mm)
        out.add("cp", REDUCE_SCATTER, calls, gathered * rope)
        out.add("cp", REDUCE_SCATTER, calls, gathered * mm)
    else:
        kv_sent = kv if kv % cp == 0 else heads
        q, k = mb * heads * local * d, mb * kv_sent * local * d
        # forward q, k, v there and the output back, backward the reverse; recompute runs q, k, v
        # again, and the output too under full recompute (its result is then saved)
        out_again = m * len(full_again)
        out.add("cp", ALL_TO_ALL, 2 * calls + again, q * rope)
        out.add("cp", ALL_TO_ALL, 2 * calls + again, k * rope)
        out.add("cp", ALL_TO_ALL, 2 * calls + again, k * mm)
        out.add("cp", ALL_TO_ALL, 2 * calls + out_again, q * mm)
    moe = sum(spec.is_moe_layer(i) for c in chunks for i in c.layers)
    if moe and spec.aux_loss_coef > 0:
        stats = mb * 2 * spec.experts * 4
        moe_again = sum(spec.is_moe_layer(i) for i in full_again)
        out.add("cp", ALL_REDUCE, m * (2 * moe + moe_again), stats)
    return out
