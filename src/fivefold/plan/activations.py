"""Bytes autograd saves for the backward on one rank at its peak: the saved-tensor count of the
runtime's own model code (fivefold.model), which `fivefold verify` measures with saved-tensor hooks.

This is the count of what this implementation keeps (every tensor each op saves, once per storage),
not the HBM estimate of `fivefold.plan.memory`, which models fused production kernels.

Per layer and micro-batch, T tokens on the rank (its cp shard), n = T/tp with SP else T, in the
run's dtypes (fp32 stream under autocast, matmul outputs in the compute dtype):
  * each RMSNorm: its input, the fp32 reciprocal RMS (n values), its output, and the projection's
    input (the gathered sequence under SP);
  * attention: rotary q and k, v, the output and its copy into the output projection, and the
    fp32 log-sum-exp (one per query head and token);
  * SwiGLU: gate, silu(gate), up and their product (f/tp wide).
Once per micro-batch: the token ids, cos/sin, and on the last stage the final norm, the logits and
their log-softmax (fp32, vocab/tp wide). Selective recompute drops the attention core's saved
tensors (q, k, v and the output are kept at its boundary); full recompute keeps each block's input.
"""

from __future__ import annotations

from fivefold.config import Layout, ModelSpec
from fivefold.plan.runshape import Chunk, RunShape


def layer_saved(run: RunShape, moe: bool) -> float:
    spec, lay = run.spec, run.layout
    t, tp, h, d = run.tokens, lay.tp, spec.hidden, spec.head_dim
    n = t // tp if lay.sp else t
    st, mm = run.stream_bytes, run.act_bytes
    if lay.recompute == "full":
        return n * h * st
    heads = spec.heads // tp
    kv = spec.kv_heads // tp if tp <= spec.kv_heads else 1
    norm = 2 * n * h * st + 4 * n + t * h * st
    core = t * heads * d * st + t * kv * d * st + t * kv * d * mm + t * heads * d * mm + 4 * t * heads
    if lay.recompute == "selective":
        core = t * heads * d * st + t * kv * d * st + t * kv * d * mm
    attn = core + t * heads * d * mm
    if moe:
        k, fe = spec.experts_per_token, spec.expert_ffn_hidden
        mlp = 4 * k * t * fe * mm + 2 * k * t * h * st + 4 * t * spec.experts
        if spec.shared_experts:
            mlp += 4 * t * fe * spec.shared_experts * mm
    else:
        mlp = 4 * t * spec.ffn_hidden // tp * mm
    return 2 * norm + attn + mlp


def micro_batch_saved(run: RunShape, chunk: Chunk) -> float:
    spec, lay = run.spec, run.layout
    t, h = run.tokens, spec.hidden
    n = t // lay.tp if lay.sp else t
    total = sum(layer_saved(run, spec.is_moe_layer(i)) for i in chunk.layers)
    total += 2 * t * spec.head_dim * run.stream_bytes  # cos, sin
    if chunk.first:
        total += 8 * t  # token ids
    if chunk.last:
        total += 2 * n * h * run.stream_bytes + 4 * n + t * h * run.stream_bytes  # final norm
        total += t * spec.vocab // lay.tp * (run.act_bytes + 4) + 8 * t + 4  # logits, log-softmax
    return total


def planned_activations(
    spec: ModelSpec,
    layout: Layout,
    micro_batch: int,
    seq_len: int,
    microbatches: int,
    dtype: str,
    coords: dict[str, int],
) -> float:
    """Peak saved bytes on the rank at `coords`: one micro-batch without pipelining (its backward
    frees it before the next forward), the micro-batches in flight on this stage with it."""
    run = RunShape(spec, layout, micro_batch, seq_len, microbatches, dtype)
    chunks = run.chunks(coords.get("pp", 0))
    per = [micro_batch_saved(run, c) for c in chunks]
    if layout.pp == 1:
        return per[0]
    flight = in_flight(layout, coords.get("pp", 0), microbatches)
    return sum(p * f for p, f in zip(per, flight))


def in_flight(layout: Layout, pp_rank: int, m: int) -> list[float]:
    """Micro-batches each of the rank's chunks holds at the rank's peak (1F1B: pp - rank warm-up
    forwards; GPipe: all of them)."""
    from fivefold.layout_math import rank_stages

    chunks = rank_stages(pp_rank, layout.pp, layout.virtual_stages, layout.pp_schedule)
    if layout.pp_schedule == "gpipe":
        return [float(m)] * len(chunks)
    stages = layout.pp * layout.virtual_stages
    return [float(min(m, stages - s)) for s in chunks]
