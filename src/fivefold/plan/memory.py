"""Memory per GPU for the worst pipeline stage: model state, activations, buffers (bytes).

Model state (Rajbhandari et al. 2020, ZeRO §5): with Ψ parameters on a rank, 16-bit weights take
param_bytes·Ψ, gradients grad_bytes·Ψ, the optimizer K·Ψ (fp32 master + Adam m, v: K = 12); stage 1
divides the optimizer by the shard group N, stage 2 also the gradients, stage 3 also the weights.
N is fsdp×cp (FSDP, HSDP) or dp×cp (DDP + sharded optimizer); routed experts are first split by ep
and then sharded over N/ep.

Activations per layer and micro-batch (Korthikanti et al. 2022 §4, generalised): for T tokens on a
rank, hidden h, tp t, the tensors a layer keeps for its backward are
  norm/residual region (÷t only with SP): norm inputs 2·2Th, norm outputs 2·2Th, dropout masks 2·Th
  attention (÷t): q, k, v 2T(d_q + 2 d_kv); scores, softmax and dropout 5·a·s·T (materialised
      attention only; FlashAttention keeps the 4-byte log-sum-exp instead); output-projection input 2T·d_q
  MLP (÷t): GeLU 2·2Tf, SwiGLU 3·2Tf; MoE: dispatched input and output 2·2kTh, experts 3·2kTf_e
      (÷t only with expert tensor parallelism: fivefold's MoE block is whole on every tp rank).
For a GPT block this is s·b·h·(10 + 24/t + 5as/(ht)) (no SP) and s·b·h·(34/t + 5as/(ht)) (SP).
Selective recompute drops the attention-core term; full recompute keeps only each layer's input
(with `recompute_layers`, only in the first blocks of each chunk: the others keep everything).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fivefold.config import Layout, ModelSpec, recomputed_blocks
from fivefold.layout_math import local_param_counts, rank_stages, replica_wrapper, spec_key, stage_split
from fivefold.plan.activations import block_saved, ends_saved, loss_saved
from fivefold.plan.pipeline import in_flight
from fivefold.plan.runshape import Chunk, RunShape
from fivefold.plan.spec import Arch, TrainShape, kv_heads_local, layer_shard

BYTES = 2
MASTER_BYTES = 4  # fp32 master weights, part of optimizer_bytes


@dataclass
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    stage: str  # the worst rank: "first", "last", "only" or "first+last" (V-shaped schedules)
    detail: dict[str, float] = field(default_factory=dict)
    # the gradients are never whole beside the activations (`grads_apart`): the peak holds the larger
    grads_apart: bool = False

    @property
    def total(self) -> float:
        held = max(self.grads, self.activations) if self.grads_apart else self.grads + self.activations
        return self.params + self.optimizer + self.buffers + held

    @property
    def apart(self) -> str | None:
        """The part the peak does not hold (the smaller of grads and activations), or None."""
        if not self.grads_apart:
            return None
        return "grads" if self.grads <= self.activations else "activations"

    def to_json(self) -> dict[str, object]:
        return {
            "params": int(self.params),
            "grads": int(self.grads),
            "optimizer": int(self.optimizer),
            "activations": int(self.activations),
            "buffers": int(self.buffers),
            "total": int(self.total),
            "grads_apart": self.grads_apart,
            "stage": self.stage,
            "detail": {k: int(v) for k, v in self.detail.items()},
        }


def model_state(
    dense: float, experts: float, zero: int, n: int, n_experts: int, shape: TrainShape
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes for `dense` and `experts` parameters under a ZeRO stage."""

    def state(nbytes: float, sharded: bool) -> float:
        return nbytes * (dense / n + experts / n_experts) if sharded else nbytes * (dense + experts)

    if zero >= 3 and shape.fp32_shard and shape.optimizer_bytes >= MASTER_BYTES:
        # the fp32 shard is the weight and the master copy: the optimizer adds only its moments
        return (
            state(MASTER_BYTES, True),
            state(shape.grad_bytes, True),
            state(shape.optimizer_bytes - MASTER_BYTES, True),
        )
    optimizer = shape.optimizer_bytes
    if shape.param_bytes >= MASTER_BYTES and optimizer >= MASTER_BYTES:
        # fp32 weights (an fp32 run) are their own master copy: the optimizer holds only its moments
        optimizer -= MASTER_BYTES
    return (
        state(shape.param_bytes, zero >= 3),
        state(shape.grad_bytes, zero >= 2),
        state(optimizer, zero >= 1),
    )


def expert_rows(model: ModelSpec, layout: Layout) -> int:
    """Routed experts a rank's ep share stacks in one tensor (0 for a dense model)."""
    return model.experts // layout.ep if model.is_moe else 0


def shard_group(layout: Layout) -> int:
    """Ranks that share one copy of the dense model state under ZeRO (fsdp×cp, else dp×cp)."""
    return layout.fsdp * layout.cp if layout.fsdp > 1 else layout.dp * layout.cp


def layer_activations(
    model: ModelSpec,
    arch: Arch,
    layout: Layout,
    micro_batch: int,
    seq_len: int,
    moe: bool,
    recompute: str,
    sac: str = "attention",
) -> float:
    """Bytes one layer keeps for its backward, for one micro-batch, on one rank."""
    t, h, hd = layout.tp, model.hidden, model.head_dim
    tokens = micro_batch * seq_len / layout.cp
    region = tokens / t if layout.sp else tokens
    if recompute == "full":
        return BYTES * region * h  # the checkpointed layer input
    if recompute == "selective" and sac == "op" and not model.is_mla:
        # torchtitan's per-op policy: the block input, the outputs of wq, wv, w1 and w2 (every second
        # matmul) and of the attention kernel (with its fp32 log-sum-exp)
        q_local, kv_local = model.heads * hd / t, kv_heads_local(model, t) * hd
        ffn = model.expert_ffn_hidden * model.experts_per_token if moe else model.ffn_hidden
        kept = region * h + tokens * (q_local + kv_local + ffn / t) + region * h + tokens * q_local
        return BYTES * kept + 4.0 * tokens * model.heads / t
    heads_local = model.heads / t
    q_local = model.heads * hd / t
    kv_local = kv_heads_local(model, t) * hd
    if model.is_mla:  # q, k, v per head of the decompressed attention + the latent
        v_dim = model.v_head_dim
        qk_dim = hd + model.qk_rope_head_dim
        qkv = BYTES * tokens * (heads_local * (2 * qk_dim + v_dim) + model.kv_lora_rank + model.q_lora_rank)
        out_in = BYTES * tokens * heads_local * v_dim
    else:
        qkv = BYTES * tokens * (q_local + 2 * kv_local)
        out_in = BYTES * tokens * q_local
    norms = (10 if arch.dropout else 8) * region * h
    if arch.flash:
        core = 0.0 if recompute == "selective" else 4.0 * heads_local * tokens
    else:
        core = 0.0 if recompute == "selective" else 5.0 * heads_local * seq_len * tokens
    if moe:
        # experts split over tp only with expert tensor parallelism (published runs); fivefold's MoE
        # block runs whole on every tp rank (as `compute.layer_time` and the parameters count it)
        k, fe, et = model.experts_per_token, model.expert_ffn_hidden, (t if arch.expert_tp else 1)
        mlp = BYTES * (2 * k * tokens * h + 3 * k * tokens * fe / et) + 4.0 * tokens * model.experts
        if model.shared_experts:
            mlp += BYTES * 3 * tokens * model.shared_experts * fe / et
    else:
        mlp = BYTES * (3 if arch.gated_mlp else 2) * tokens * model.ffn_hidden / t
    return norms + qkv + core + out_in + mlp


def eager_count(model: ModelSpec, arch: Arch, shape: TrainShape) -> bool:
    """Whether a stage's saved activations are counted as fivefold's eager model code keeps them
    (`fivefold.plan.activations`, what `verify` measures to the byte): for fivefold's own runtime
    without torch.compile, on the block it runs (SwiGLU, standard attention, Megatron-style selective
    recompute). Fused kernels (compiled, published trainers) keep what Korthikanti et al. count."""
    return (
        shape.saved_as_eager
        and _runtime_block(model, arch)
        and shape.sac == "attention"
        and shape.attention != "materialized"  # its SDPA never keeps the scores
        and not shape.offload_checkpoints
    )


V_SCHEDULES = ("zbv", "dualpipev")
BOTH_ENDS = "first+last"  # rank 0 of a V-shaped schedule holds the first and the last chunk
MIDDLE = "mid"  # "mid3": pp rank 3, neither end of the pipeline


def stage_names(layout: Layout, model: ModelSpec | None = None, seq_len: int = 0) -> list[str]:
    """The ranks whose memory and time bound the step: the ends of the pipeline and, given the
    model, one middle rank per distinct layer count (the lowest such rank: it holds the most
    micro-batches in flight). With the cost-balanced split the ends hold fewer layers than the
    middle (they also run the embedding or the head), so a middle rank can set the pace."""
    if layout.pp == 1:
        return ["only"]
    ends = [BOTH_ENDS] if layout.pp_schedule in V_SCHEDULES else ["first", "last"]
    if model is None or layout.pp <= 2 - (layout.pp_schedule in V_SCHEDULES):
        return ends
    return ends + list(_middles(model, layout, seq_len))


def stage_weights(layout: Layout, model: ModelSpec, seq_len: int = 0) -> dict[str, int]:
    """How many pp ranks each of `stage_names` stands for (a middle rank: all with its layer count)."""
    names = stage_names(layout, model, seq_len)
    mids = _middles(model, layout, seq_len) if layout.pp > 1 else {}
    return {n: mids.get(n, 1) for n in names}


def _middles(model: ModelSpec, layout: Layout, seq_len: int) -> dict[str, int]:
    seq_len = seq_len or model.max_seq_len
    key = _split_key(model, layout, seq_len)
    if key not in _MIDDLES:
        counts, first, ranks = _rank_layers(model, layout, seq_len), {}, {}
        last = layout.pp if layout.pp_schedule in V_SCHEDULES else layout.pp - 1
        for rank in range(1, last):
            first.setdefault(counts[rank], rank)
            ranks[counts[rank]] = ranks.get(counts[rank], 0) + 1
        _MIDDLES[key] = {f"{MIDDLE}{first[c]}": ranks[c] for c in sorted(first, key=first.get)}
    return _MIDDLES[key]


_MIDDLES: dict[tuple, dict[str, int]] = {}


def stage_rank(which: str, pp: int) -> int:
    """The pp rank a stage name stands for."""
    if which.startswith(MIDDLE):
        return int(which[len(MIDDLE) :])
    return pp - 1 if which == "last" else 0


def holds_embedding(which: str) -> bool:
    return which in ("first", "only", BOTH_ENDS)


def holds_head(which: str) -> bool:
    return which in ("last", "only", BOTH_ENDS)


def stage_counts(
    model: ModelSpec, pp: int, which: str, layout: Layout | None = None, seq_len: int = 0
) -> tuple[int, int]:
    """(dense layers, MoE layers) on a stage; MoE layers are the model's last ones.

    Given the layout, the stage holds what the run gives it: the cost-balanced split (or
    `--pp-split`) of fivefold.layout_math, all of the rank's chunks. Without it, ceil(L/pp) layers.
    """
    if layout is not None and pp > 1:
        return _rank_layers(model, layout, seq_len or model.max_seq_len)[stage_rank(which, pp)]
    per = math.ceil(model.layers / pp)
    if which == BOTH_ENDS:  # half a stage from the front, half from the back
        front = math.ceil(per / 2)
        spans = [(0, front), (model.layers - (per - front), model.layers)]
    else:
        start = 0 if which in ("first", "only") else model.layers - per
        spans = [(start, start + per)]
    n_moe = 0
    if model.is_moe:
        n_moe = sum(max(0, end - max(start, model.first_moe_layer)) for start, end in spans)
    return per - n_moe, n_moe


_SPLITS: dict[tuple, list[tuple[int, int]]] = {}


def _model_key(model: ModelSpec) -> tuple:
    return (
        model.name,
        model.layers,
        model.hidden,
        model.ffn_hidden,
        model.vocab,
        model.experts,
        model.moe_layers,
    )


def _split_key(model: ModelSpec, layout: Layout, seq_len: int) -> tuple:
    return (_model_key(model), layout.pp, layout.virtual_stages, layout.pp_schedule, layout.pp_split, seq_len)


def _chunk_sizes(model: ModelSpec, layout: Layout, seq_len: int = 0) -> list[int]:
    """Layers of every model chunk, first to last (the whole model without pipelining)."""
    if layout.pp == 1:
        return [model.layers]
    return stage_split(model, layout, seq_len or model.max_seq_len)


def chunk_layers(model: ModelSpec, layout: Layout, seq_len: int, rank: int) -> list[range]:
    """The layers of each chunk pp rank `rank` holds (the whole model without pipelining)."""
    if layout.pp == 1:
        return [range(model.layers)]
    counts = _chunk_sizes(model, layout, seq_len)
    starts = [sum(counts[:k]) for k in range(len(counts))]
    stages = rank_stages(rank, layout.pp, layout.virtual_stages, layout.pp_schedule)
    return [range(starts[c], starts[c] + counts[c]) for c in stages]


def _dense_and_moe(model: ModelSpec, layers: list[int]) -> tuple[int, int]:
    n_moe = sum(model.is_moe_layer(i) for i in layers)
    return len(layers) - n_moe, n_moe


def _rank_layers(model: ModelSpec, layout: Layout, seq_len: int) -> list[tuple[int, int]]:
    """(dense, MoE) layers of every pp rank, all its chunks together."""
    key = _split_key(model, layout, seq_len)
    if key not in _SPLITS:
        _SPLITS[key] = [
            _dense_and_moe(model, [i for chunk in chunk_layers(model, layout, seq_len, rank) for i in chunk])
            for rank in range(layout.pp)
        ]
    return _SPLITS[key]


def recomputed_counts(model: ModelSpec, layout: Layout, which: str, seq_len: int = 0) -> tuple[int, int]:
    """(dense, MoE) layers of a stage that full recompute re-runs: the first `recompute_layers` blocks
    of each chunk the rank holds (`recomputed_blocks`, the rule the runtime wraps blocks by)."""
    if layout.recompute != "full":
        return 0, 0
    seq_len = seq_len or model.max_seq_len
    key = ("rc", *_split_key(model, layout, seq_len), layout.recompute_layers, which)
    if key not in _SPLITS:
        chunks = chunk_layers(model, layout, seq_len, stage_rank(which, layout.pp))
        again = [
            i for ch in chunks for i in ch[: recomputed_blocks("full", layout.recompute_layers, len(ch))]
        ]
        _SPLITS[key] = [_dense_and_moe(model, again)]
    return _SPLITS[key][0]


def most_chunk_layers(model: ModelSpec, layout: Layout, seq_len: int = 0) -> int:
    """Layers of the largest model chunk: `recompute_layers` at or above it recomputes every block."""
    return max(_chunk_sizes(model, layout, seq_len))


def recomputed_fraction(model: ModelSpec, layout: Layout, seq_len: int = 0) -> float:
    """Share of the model's layers that full recompute re-runs (1.0 for plain full recompute)."""
    if layout.recompute != "full":
        return 0.0
    counts = _chunk_sizes(model, layout, seq_len)
    return sum(recomputed_blocks("full", layout.recompute_layers, c) for c in counts) / model.layers


def stage_params(
    model: ModelSpec, arch: Arch, layout: Layout, which: str, seq_len: int = 0
) -> tuple[float, float, float]:
    """(dense, expert, one-layer) parameters a rank of this stage holds after tp and ep, its layers
    split as for sequences of `seq_len` (the run's: `fivefold.layout_math.stage_split`)."""
    n_dense, n_moe = stage_counts(model, layout.pp, which, layout, seq_len)
    dense = experts = biggest = 0.0
    for count, moe in ((n_dense, False), (n_moe, True)):
        if count:
            shard = layer_shard(model, arch, layout, moe)
            dense += count * (shard.dense + shard.replicated)
            experts += count * shard.experts
            biggest = max(biggest, shard.dense + shard.replicated + shard.experts)
    emb = model.vocab * model.hidden / layout.tp
    first, last = holds_embedding(which), holds_head(which)
    if first:
        dense += emb
    if last and (not arch.tied or not first):
        dense += emb  # the output head (a second copy of tied embeddings on another rank)
    dense += model.hidden if last else 0  # final norm
    return dense, experts, biggest


def runtime_stage_params(
    model: ModelSpec, layout: Layout, which: str, seq_len: int = 0
) -> tuple[float, float, float]:
    """`stage_params` as fivefold's runtime holds them, tensor by tensor (the exact step's
    `plan/state.py` cuts them the same way before FSDP): K/V projections whole where tp exceeds the
    KV heads, biases and q/k norms, a pipeline's own head copy of tied embeddings. Kept across plans
    (the explorer's lab and a search plan thousands of layouts of one model)."""
    key = (spec_key(model), seq_len, layout.tp, layout.pp, layout.ep, layout.virtual_stages)
    key += (layout.pp_schedule, layout.pp_split, which)
    if key not in _RUNTIME_PARAMS:
        if len(_RUNTIME_PARAMS) > 8192:  # a long-lived process planning many models
            _RUNTIME_PARAMS.clear()
        _RUNTIME_PARAMS[key] = _runtime_stage_params(model, layout, which, seq_len)
    return _RUNTIME_PARAMS[key]


_RUNTIME_PARAMS: dict[tuple, tuple[float, float, float]] = {}


def _runtime_stage_params(
    model: ModelSpec, layout: Layout, which: str, seq_len: int
) -> tuple[float, float, float]:
    counts = local_param_counts(model, layout.tp, layout.ep)
    dense = experts = biggest = 0.0
    for chunk in chunk_layers(model, layout, seq_len, stage_rank(which, layout.pp)):
        if chunk:
            dense += counts.dense[chunk.stop] - counts.dense[chunk.start]
            experts += counts.experts[chunk.stop] - counts.experts[chunk.start]
            biggest = max(biggest, max(counts.totals[chunk.start : chunk.stop]))
    if holds_embedding(which):
        dense += counts.ends["model.embed_tokens.weight"]
    if holds_head(which):
        dense += counts.ends["model.norm.weight"]
        if layout.pp > 1 or not model.tie_embeddings:  # a pipeline's last chunk keeps its own copy
            dense += counts.ends["lm_head.weight"]
    return dense, experts, biggest


def memory(
    model: ModelSpec,
    arch: Arch,
    layout: Layout,
    shape: TrainShape,
    microbatches: int,
    memo: dict | None = None,
) -> Memory:
    """Memory of the worst rank: the largest of the pipeline's ends and its middle ranks.

    `memo` (a dict the caller owns, for one model, arch and shape) caches per-layer pieces across
    layouts; the search passes one.
    """
    stages = stage_names(layout, model, shape.seq_len)
    memo = {} if memo is None else memo
    return max(
        (_stage_memory(model, arch, layout, shape, microbatches, s, memo) for s in stages),
        key=lambda mem: mem.total,
    )


def stage_memory(
    model: ModelSpec, arch: Arch, layout: Layout, shape: TrainShape, microbatches: int, which: str
) -> Memory:
    """The memory of one stage (`stage_names`' `which`), where `memory` gives the worst."""
    return _stage_memory(model, arch, layout, shape, microbatches, which, {})


def cached_stage_params(
    model: ModelSpec,
    arch: Arch,
    layout: Layout,
    which: str,
    memo: dict,
    seq_len: int = 0,
    exact: bool = False,
) -> tuple[float, float, float]:
    """`stage_params`, or with `exact` (fivefold's runtime) `runtime_stage_params`, kept in `memo`."""
    key = (
        "params",
        exact,
        layout.tp,
        layout.pp,
        layout.ep,
        layout.virtual_stages,
        layout.pp_schedule,
        layout.pp_split,
        which,
    )
    if key not in memo:
        if exact:
            memo[key] = runtime_stage_params(model, layout, which, seq_len)
        else:
            memo[key] = stage_params(model, arch, layout, which, seq_len)
    return memo[key]


def runs_own_tensors(model: ModelSpec, arch: Arch, shape: TrainShape) -> bool:
    """Whether the plan holds fivefold's runtime's own parameter tensors (`runtime_stage_params`):
    its runtime, on the block it builds."""
    return shape.fp32_weights and _runtime_block(model, arch)


def _runtime_block(model: ModelSpec, arch: Arch) -> bool:
    """Whether `arch` is the block fivefold's model code builds: SwiGLU, standard attention, the MoE
    block whole on every tp rank."""
    return arch.gated_mlp and not arch.expert_tp and not model.is_mla


def expert_pad(rows: int, group: int) -> float:
    """How much FSDP's shards of stacked experts [rows, ...] outweigh their share: FSDP splits dim 0,
    padded up to a multiple of its group, so with fewer local experts than ranks each rank still
    holds (and gathers) whole experts (`fivefold.plan.state`, the exact count, pads the same)."""
    return math.ceil(rows / group) * group / rows if rows > 0 and group > 1 else 1.0


def stage_state(
    dense: float, experts: float, layout: Layout, shape: TrainShape, expert_rows: int = 0
) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer, compute-dtype copies of the weights) of a rank holding `dense`
    and `experts` parameters: the trainer's own accounting (`TrainShape.fp32_weights`). Under FSDP the
    stacked experts' `expert_rows` (experts a rank's ep share holds) pad its shards (`expert_pad`)."""
    n = shard_group(layout)
    n_exp: float = max(n // layout.ep, 1)
    if layout.fsdp > 1:
        n_exp /= expert_pad(expert_rows, int(n_exp))
    if shape.fp32_weights:
        return _fp32_weights_state(dense, experts, layout, shape, n, n_exp)
    return (*model_state(dense, experts, layout.zero, n, n_exp, shape), 0.0)


def _fp32_weights_state(
    dense: float, experts: float, layout: Layout, shape: TrainShape, n: int, n_exp: int
) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer, compute-dtype copies) of a runtime that keeps fp32 weights as
    their own master (fivefold's: Adam adds only its moments) and casts them for the compute: FSDP2
    shards them over fsdp×cp at zero 2 as at 3, and at zero 2 keeps the stage gathered from its
    forward to its backward (`reshard_after_forward=False`); `replicate` (tp beside data replicas)
    keeps a bf16 copy; autocast (DDP, ZeRO-1, tp alone) casts per matmul. The exact step's state
    (`plan/state.py`, what `verify` measures) is the first three."""
    sharded = layout.zero >= 2 and n > 1
    width, whole = shape.act_bytes, dense + experts
    shard = dense / n + experts / n_exp
    params = MASTER_BYTES * (shard if sharded else whole)
    grads = shape.grad_bytes * (shard if sharded else whole)
    moments = shape.optimizer_bytes - MASTER_BYTES
    optimizer = moments * (shard if sharded else whole)
    if layout.zero == 1:  # ZeroRedundancyOptimizer partitions over the dp ranks alone
        optimizer = moments * whole / layout.dp
    if sharded:  # zero 3's gathered units are the `fsdp_gather` buffer
        return params, grads, optimizer, (width * whole if layout.zero == 2 else 0.0)
    # in 16 bits `replicate`'s bf16 copy, or autocast's casts (saved activations when eager)
    return params, grads, optimizer, (width * whole if width < MASTER_BYTES else 0.0)


def _stage_memory(
    model: ModelSpec, arch: Arch, layout: Layout, shape: TrainShape, m: int, which: str, memo: dict
) -> Memory:
    dense, experts, biggest = cached_stage_params(
        model, arch, layout, which, memo, shape.seq_len, runs_own_tensors(model, arch, shape)
    )
    n = shard_group(layout)
    z = layout.zero
    n_dense, n_moe = stage_counts(model, layout.pp, which, layout, shape.seq_len)
    rc = layout.recompute
    eager = eager_count(model, arch, shape)
    params, grads, optimizer, copies = stage_state(dense, experts, layout, shape, expert_rows(model, layout))
    if eager:  # the run as the exact count sees it (its dtypes: autocast depends on dp and fsdp)
        run = RunShape(model, layout, shape.micro_batch, shape.seq_len, m, shape.dtype)
        autocast = run.autocast
        if autocast:  # autocast's bf16 copies are saved for the backward: activations
            copies = 0.0
    if shape.offload_optimizer:  # master weights and moments live on the host
        if z >= 3 and shape.fp32_shard and shape.optimizer_bytes >= MASTER_BYTES:
            params = params * shape.param_bytes / MASTER_BYTES  # a 16-bit shard stays on the device
        optimizer = 0.0

    def act(moe: bool, recompute: str) -> float:
        if eager:  # what the runtime's own block keeps, in its dtypes (autocast depends on dp, fsdp;
            # an MoE block's expert weight casts on ep and fsdp)
            key = ("saved", layout.tp, layout.cp, layout.sp, layout.cp_impl, autocast, shape.micro_batch)
            key += (moe, recompute) + ((layout.ep, layout.fsdp) if moe else ())
            if key not in memo:
                mb, seq = shape.micro_batch, shape.seq_len
                memo[key] = block_saved(model, layout, mb, seq, shape.dtype, moe, recompute)
            return memo[key]
        key = ("act", layout.tp, layout.cp, layout.sp, shape.micro_batch, moe, recompute, shape.sac)
        if key not in memo:
            memo[key] = layer_activations(
                model, arch, layout, shape.micro_batch, shape.seq_len, moe, recompute, shape.sac
            )
        return memo[key] * shape.act_bytes / BYTES  # counted in 16-bit elements; fp32 runs keep twice

    r_dense, r_moe = recomputed_counts(model, layout, which, shape.seq_len)
    # (layers, of them recomputed whole, MoE?)
    kinds = [(c, r, moe) for c, r, moe in ((n_dense, r_dense, False), (n_moe, r_moe, True)) if c]
    kept = "none" if rc == "full" else rc  # what a block full recompute leaves alone keeps
    per_layer = {moe: act(moe, kept) for *_, moe in kinds}
    flight = in_flight(layout.pp_schedule, layout.pp, m, layout.virtual_stages, stage_rank(which, layout.pp))
    # a checkpointed block keeps its input, on the host when checkpoints are offloaded (one layer's
    # input comes back before its recompute)
    checkpoint = 0.0 if shape.offload_checkpoints else 1.0
    activations = flight * sum(
        (c - r) * per_layer[moe] + r * checkpoint * act(moe, "full") for c, r, moe in kinds
    )
    if eager:  # beside the blocks: the rotary table, the head and the loss of each micro-batch in
        # flight, and the step's token ids and targets, held from the first forward to the last backward
        first, last = holds_embedding(which), holds_head(which)
        whole = any(c > r for c, r, _ in kinds)
        key = ("ends", layout.tp, layout.cp, layout.sp, autocast, shape.micro_batch, whole)
        if key not in memo:  # (the rotary table; the final norm and head; the loss)
            rotary = ends_saved(run, Chunk(0, (), True, False), whole)
            loss = loss_saved(run, Chunk(0, (), False, True), ids=False)
            memo[key] = (rotary, ends_saved(run, Chunk(0, (), True, True), whole) - rotary - loss, loss)
        rotary, head, loss = memo[key]
        # a pipeline's last chunk runs each micro-batch's backward right after its forward: one
        # micro-batch's head and loss at a time, whatever the rank's flight (its other chunks'), but
        # in all-forwards-first GPipe; zero-bubble's input pass frees only the loss, and the head
        # waits for the weight pass with the rest of the last rank's flight (a V schedule's last chunk,
        # on rank 0, runs its weight passes soon after: measured, one micro-batch's)
        one = layout.pp > 1 and layout.pp_schedule != "gpipe"
        waits = layout.pp_schedule == "zero-bubble" or not one
        activations += flight * rotary
        activations += last * (flight if waits else min(flight, 1.0)) * head
        activations += last * (min(flight, 1.0) if one else flight) * loss
        # (with cp and no pipeline, each micro-batch's sequence shard is a copy of its own)
        held = 1 if layout.cp > 1 and layout.pp == 1 else m
        activations += 8 * run.tokens * held * (first + last)
    working = 0.0
    if r_dense + r_moe:  # during the backward one layer's activations are rebuilt at a time
        working = max(act(moe, "none") for c, r, moe in kinds if r)
    elif rc == "selective" and kinds:  # and one layer's recomputed attention core (its scores, where
        # the kernel materialises them), alive from its recompute to the end of its backward
        # (never below nothing: the eager checkpoint keeps q and k in the fp32 stream under autocast,
        # more than the flash kernel's own bf16 copies)
        working = max(max(act(moe, "none") - act(moe, "selective"), 0.0) for *_, moe in kinds)
    tokens = shape.micro_batch * shape.seq_len / layout.cp
    logits = 0.0
    if holds_head(which):  # 16-bit logits + fp32 softmax kept by the vocab-parallel loss
        logits = (shape.act_bytes + (0 if shape.fused_loss else 4)) * tokens * model.vocab / layout.tp
    gather = 0.0
    if shape.live_params:
        biggest = min(biggest, shape.live_params)
    if z >= 2 and n > 1:  # unsharded grads of one layer before the reduce-scatter
        gather += shape.grad_bytes * biggest
    if z >= 3 and n > 1:  # the gathered layer being used and the next one prefetched
        gather += 2 * shape.param_bytes * biggest
    buffers = logits + gather + working + copies
    detail = {
        # a first or last stage may hold no layer at all (`--pp-split 0,32`): only the embedding or head
        "activations_per_layer": max(
            (act(moe, "full") if r == c else per_layer[moe] for c, r, moe in kinds), default=0.0
        ),
        "in_flight_microbatches": flight,
        "layers_on_stage": n_dense + n_moe,
        "logits": logits,
        "fsdp_gather": gather,
        "weight_copies": copies,
        "recompute_working": working,
        "params_on_rank": dense + experts,
    }
    apart = grads_apart(layout, shape, m)
    return Memory(params, grads, optimizer, activations, buffers, which, detail, apart)


def grads_apart(layout: Layout, shape: TrainShape, microbatches: int) -> bool:
    """Whether a step never holds its whole gradients beside its whole activations. fivefold's runtime
    frees the gradients between steps (`zero_grad(set_to_none=True)`) and its backward builds them
    as it frees the activations; with one micro-batch a step on a rank (no accumulation, no pipeline)
    and no torch DDP (whose buckets are allocated once, for every step), the peak is the larger of
    the two. Measured: the H200 bench model's eager peak is the plan without its gradients to 0.01 GB,
    and on the CPU a 67M-parameter step's peak beyond its weights and moments is its activations (4
    sequences) or its gradients (1 sequence), not their sum. Published trainers keep persistent
    gradient buffers (Megatron's, DeepSpeed's): there the two add."""
    ddp = replica_wrapper(layout) == "ddp"
    return shape.fp32_weights and microbatches == 1 and layout.pp == 1 and not ddp
