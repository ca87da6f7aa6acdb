"""Tensor (+ sequence) parallel traffic of one step on one rank (fivefold.parallel.tensor's splits).

Per micro-batch and b·s·h activation A (this rank's sequence shard under cp):
  * without SP: one all_reduce of A per row-parallel output forward (attention o, MLP down) and per
    block input backward; MoE blocks run replicated, so only attention's two. The vocabulary-parallel
    embedding all-reduces its output forward; the head's input gradient is all-reduced backward.
  * with SP: each of those becomes an all_gather (entering) plus a reduce_scatter (leaving) and the
    ends swap direction; MoE blocks gather their input and their output gradient, scatter nothing.
  * full recompute runs each recomputed block's forward collectives again in the backward, except
    the last (torch's non-reentrant checkpoint stops once the saved tensors are rebuilt).
  * bf16 without FSDP (autocast): matmul outputs are bf16, the residual stream and norms fp32;
    the inputs of attention and dense MLPs are cast to bf16 before they are gathered.
  * the loss on vocabulary shards (loss_parallel): three all_reduces of one fp32 value per token
    forward (max logit, sum of exponentials, target logit).
  * with each gradient sync: partial weight gradients of SP norms and of per-head q/k norms (one
    micro-batch's in the weights' dtype, an accumulated one in fp32), and, in the backward, of
    replicated K/V projections and their biases (tp > kv heads; in the weights' dtype).
"""

from __future__ import annotations

from fivefold.layout_math import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from fivefold.plan.runshape import Chunk, RunShape, Traffic

FP32_BYTES = 4  # an accumulated gradient's reduce dtype, whatever the compute dtype


def tensor_traffic(run: RunShape, chunks: list[Chunk]) -> Traffic:
    lay, spec = run.layout, run.spec
    out = Traffic()
    if lay.tp == 1:
        return out
    m = run.microbatches
    act = run.tokens * spec.hidden
    mm, st = act * run.act_bytes, act * run.stream_bytes  # matmul outputs; the residual stream
    for chunk in chunks:
        moe = sum(spec.is_moe_layer(i) for i in chunk.layers)
        dense = len(chunk.layers) - moe
        again = run.again([chunk])
        moe_again = sum(spec.is_moe_layer(i) for i in again)  # recomputed blocks, MoE and dense
        dense_again = len(again) - moe_again
        ends = int(chunk.first) + int(chunk.last)
        # forward: block inputs (stream) in, matmul outputs out; backward the other way round.
        # Early-stopping recompute (torch.utils.checkpoint) skips a block's last collective.
        # Inputs of attention and of dense MLPs are cast to the compute dtype by the block before
        # they are gathered (their gradients come back in it); an MoE layer's input and the ends
        # stay in the stream dtype.
        cast_inputs = 2 * dense + moe  # per micro-batch: attention in every layer, dense MLPs
        outputs = 2 * dense + moe  # row-parallel outputs: attention's o in every layer, dense MLPs' down
        if lay.sp:
            out.add("tp", ALL_GATHER, m * (2 * moe + ends + moe_again), st)
            out.add("tp", ALL_GATHER, m * (cast_inputs + 2 * dense_again + moe_again), mm)
            out.add("tp", ALL_GATHER, m * outputs, mm)
            out.add("tp", REDUCE_SCATTER, m * (outputs + len(again)), mm)
            out.add("tp", REDUCE_SCATTER, m * cast_inputs, mm)
            out.add("tp", REDUCE_SCATTER, m * ends, st)
        else:
            out.add("tp", ALL_REDUCE, m * (outputs + len(again)), mm)
            out.add("tp", ALL_REDUCE, m * cast_inputs, mm)
            out.add("tp", ALL_REDUCE, m * ends, st)
        if chunk.last:  # loss_parallel's reductions over the vocabulary shards
            out.add("tp", ALL_REDUCE, 3 * m, run.tokens * 4)
        # partial weight gradients are reduced with each gradient sync: every micro-batch's with FSDP
        # (outside a pipeline), else once a step
        syncs = run.fsdp_syncs if lay.fsdp > 1 else 1
        # the norm weights': one micro-batch's gradient is in the weights' compute dtype (bf16 where
        # FSDP's or replicate's mixed precision casts them); one accumulated over several without a
        # sync is kept in the reduce dtype, fp32
        width = run.weight_bytes if run.microbatches == syncs else FP32_BYTES
        if lay.sp:  # SP's norms, over their sequence shards
            norms = 2 * len(chunk.layers) + int(chunk.last)
            out.add("tp", ALL_REDUCE, norms * syncs, spec.hidden * width)
        if spec.qk_norm:  # per-head q/k norms, over the rank's heads (with or without sp)
            out.add("tp", ALL_REDUCE, 2 * len(chunk.layers) * syncs, spec.head_dim * width)
        if lay.tp > spec.kv_heads:  # replicated K/V projections' partial gradients, reduced in the
            # backward in the weights' dtype (bf16 under FSDP's mixed precision)
            kv = spec.kv_heads * spec.head_dim * spec.hidden * run.weight_bytes
            out.add("tp", ALL_REDUCE, 2 * len(chunk.layers) * syncs, kv)
            if spec.attention_bias:  # and their biases', each its own reduction
                bias = spec.kv_heads * spec.head_dim * run.weight_bytes
                out.add("tp", ALL_REDUCE, 2 * len(chunk.layers) * syncs, bias)
    return out
