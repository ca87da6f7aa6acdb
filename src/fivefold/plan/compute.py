"""Compute time of one transformer layer, the head and the optimizer, op by op, on a roofline.

Each matmul takes max(FLOPs / (peak·matmul_efficiency·d/(d+gemm_half_dim)), bytes / (HBM·memory_efficiency)),
d its smallest dimension (tile and wave quantisation make thin matmuls slower); each
elementwise op (norms, activations, residual adds, dropout, softmax, rotary) takes its bytes over the
sustained HBM bandwidth. The backward of a matmul is two matmuls of the same shape; FlashAttention's
backward costs 2.5 forwards (it recomputes the scores), and each of its query blocks pays a fixed
cost worth attention_fixed_keys keys' scores, which short and causal sequences feel most. Knobs
(physical, per hardware, see docs/planner.md): matmul_efficiency, memory_efficiency; attention
kernels reach ATTENTION_RATIO of the matmul efficiency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.config.hardware import DEFAULT_ATTENTION_FIXED_KEYS, DEFAULT_GEMM_HALF_DIM, host_threads
from fivefold.plan.spec import Arch, kv_heads_local

DEFAULT_MATMUL_EFFICIENCY = 0.75  # large bf16 GEMM, fraction of the dense peak
DEFAULT_MEMORY_EFFICIENCY = 0.80  # streaming elementwise kernels, fraction of HBM bandwidth
DEFAULT_FP8_SPEEDUP = 1.4  # fp8 over 16-bit matmul rate, end to end (peak ratio 2)
# FlashAttention-3 / cuDNN fused attention over FlashAttention-2 on H100 (Shah et al. 2024: 1.5-2.0×)
FLASH3_SPEEDUP = 1.75
ATTENTION_RATIO = 0.80  # attention kernels relative to plain GEMMs (softmax, masking, tiling)
# every step also pays a time no layout changes: the step's small host-synchronised collectives (loss,
# grad norm, found-inf) and the wait for the slowest rank before them. Both grow with the depth of the
# reduction tree, log2(GPUs), and vanish on one GPU, whose measured step is compute plus Adam's stream
# (benchmarks/bench_gpu.md). The knob is the overhead at 64 GPUs (fitted, docs/planner.md).
DEFAULT_STEP_OVERHEAD_S = 0.05  # its prior: the bundled runs leave it there (docs/planner.md)
OVERHEAD_REFERENCE_GPUS = 64
OPTIMIZER_BYTES_PER_PARAM = 34  # Adam step: read grad + master/m/v, write master/m/v/16-bit param, zero grad
BYTES = 2  # 16-bit activations
HOST_LINK_BPS = 25e9  # PCIe 4.0 x16 per GPU, one direction, sustained
HOST_MEMORY_BPS = 25e9  # a GPU's share of its host's DRAM bandwidth (8 GPUs on ~200 GB/s)
EAGER_TRAFFIC = 3.0  # unfused elementwise ops re-read and re-write their tensors about three times
# Attention kernels run at head_dim / (head_dim + ATTENTION_HALF_DIM) of their best rate: the softmax
# work per score is fixed while the matmul work grows with the head dim. FlashAttention-3's published
# H100 forward rates (497, 648, 756 TFLOP/s at head dims 64, 128, 256) fit 56 within 2 %; the fitted
# attention_efficiency is the rate at head dim 128, where most models sit.
ATTENTION_HALF_DIM = 56
REFERENCE_HEAD_DIM = 128


def head_dim_factor(head_dim: float) -> float:
    """Attention rate at `head_dim` relative to head dim 128 (the knob's reference)."""
    ref = REFERENCE_HEAD_DIM / (REFERENCE_HEAD_DIM + ATTENTION_HALF_DIM)
    return head_dim / (head_dim + ATTENTION_HALF_DIM) / ref


def host_threads_of(hw: HardwareSpec) -> float:
    """The cores a rank of `hw` computes with: `threads_per_rank` on a CPU device, else 1. A rank
    with t threads runs its matmuls and streams at t cores' rates (one thread's 256- to 1024-wide fp32
    matmuls ran 1.9-2.1x faster on two here, large elementwise ops 1.6-1.7x); its per-op host work
    (`block_dispatch_us`) does not shrink."""
    return max(hw.threads_per_rank, 1.0) if not hw.comm_overlap else 1.0


def on_this_host(hw: HardwareSpec, world: int, gpus_per_node: int) -> HardwareSpec:
    """`hw` with the threads `fivefold train` gives each rank of a `world`-rank run on this machine,
    where `hw` is a CPU device that does not say (`threads_per_rank` 0)."""
    if hw.comm_overlap or hw.threads_per_rank > 0:
        return hw
    return replace(hw, threads_per_rank=float(host_threads(min(world, gpus_per_node))))


def clock_factor(hw: HardwareSpec) -> float:
    """Tensor-core clock under an operator's power cap: dynamic power grows as f·V² with V ∝ f, so
    the sustained clock scales as the cube root of the power allowed."""
    if hw.power_limit_w and hw.tdp_w and hw.power_limit_w < hw.tdp_w:
        return (hw.power_limit_w / hw.tdp_w) ** (1 / 3)
    return 1.0


@dataclass(frozen=True)
class Efficiencies:
    """The shares of its peaks a device's plans run at: its spec's where it gives them (fitted or
    calibrated), the defaults above where not."""

    matmul: float
    attention: float  # of the dense peak, at head dim 128
    memory: float
    fp8_speedup: float

    @classmethod
    def of(cls, hw: HardwareSpec) -> Efficiencies:
        mm = hw.matmul_efficiency or DEFAULT_MATMUL_EFFICIENCY
        return cls(
            matmul=mm,
            attention=hw.attention_efficiency or mm * ATTENTION_RATIO,
            memory=hw.memory_efficiency or DEFAULT_MEMORY_EFFICIENCY,
            fp8_speedup=hw.fp8_speedup or DEFAULT_FP8_SPEEDUP,
        )


@dataclass(frozen=True)
class Rates:
    flops: float  # sustained matmul FLOP/s
    attn_flops: float
    hbm: float  # sustained bytes/s
    half_dim: float = DEFAULT_GEMM_HALF_DIM  # HardwareSpec.gemm_half_dim
    fixed_keys: float = DEFAULT_ATTENTION_FIXED_KEYS  # HardwareSpec.attention_fixed_keys
    block_dispatch: float = 0.0  # seconds, HardwareSpec.block_dispatch_us

    @classmethod
    def of(
        cls, hw: HardwareSpec, fp8: bool = False, attention: str = "flash", act_bytes: int = BYTES
    ) -> Rates:
        eff = Efficiencies.of(hw)
        threads = host_threads_of(hw)
        peak = hw.peak_tflops * 1e12 * clock_factor(hw) * threads
        dense = peak * eff.matmul
        # fp8 linears: the tensor-core peak doubles, but casts and scaling eat part of it; the
        # attention core stays in 16 bits
        speedup = eff.fp8_speedup if fp8 else 1.0
        attn = peak * eff.attention
        if attention == "flash3":
            attn *= FLASH3_SPEEDUP
        # traffic is counted in 16-bit elements: wider ones (fp32 training) stream proportionally slower
        return cls(
            dense * speedup,
            attn,
            hw.hbm_gbps * 1e9 * eff.memory * BYTES / act_bytes * threads,
            hw.gemm_half_dim,
            hw.attention_fixed_keys,
            hw.block_dispatch_us * 1e-6 if not hw.comm_overlap else 0.0,
        )

    def gemm(self, m: float, k: float, n: float, count: float = 1.0) -> float:
        """Seconds for `count` matmuls (m×k)·(k×n) in 16 bits, on the roofline."""
        flops = 2.0 * m * k * n
        traffic = BYTES * (m * k + k * n + m * n)
        shape_eff = 1.0 / (1.0 + self.half_dim / min(m, k, n))  # thin matmuls fill fewer tiles
        return count * max(flops / (self.flops * shape_eff), traffic / self.hbm)

    def stream(self, nbytes: float) -> float:
        return nbytes / self.hbm


@dataclass(frozen=True)
class LayerTime:
    """One layer, one micro-batch, one rank (compute only; communication is added by the caller)."""

    fwd: float
    bwd: float
    attn_core_fwd: float  # the part selective recompute redoes
    wgrad: float  # weight-gradient matmuls of the backward (they hide the tp input-gradient collectives)
    flops_fwd: float  # executed forward FLOPs (hardware)
    # what torchtitan's per-op selective checkpointing redoes in the backward: every elementwise op
    # and every second matmul (wk, wo, w3 of a Llama block; their share of the matmul time)
    op_redo: float = 0.0

    def redo(self, policy: str) -> float:
        """Seconds selective recompute adds to the backward under `policy` (TrainShape.sac)."""
        return self.op_redo if policy == "op" else self.attn_core_fwd


def layer_time(
    model: ModelSpec,
    arch: Arch,
    layout: Layout,
    micro_batch: int,
    seq_len: int,
    rates: Rates,
    moe: bool,
    fused: bool = True,
    causal_skip: bool = True,
) -> LayerTime:
    h, hd, tp = model.hidden, model.head_dim, layout.tp
    tokens = micro_batch * seq_len / layout.cp
    norm_tokens = tokens / tp if layout.sp else tokens
    q_local = model.heads * hd / tp
    kv_local = kv_heads_local(model, tp) * hd
    heads_local = model.heads / tp
    gemm_fwd = 0.0
    flops = 0.0

    def mm(m: float, k: float, n: float, count: float = 1.0) -> None:
        nonlocal gemm_fwd, flops
        gemm_fwd += rates.gemm(m, k, n, count)
        flops += 2.0 * m * k * n * count

    # attention projections
    if model.is_mla:
        mm(tokens, h, model.attention_params() / (tp * h))
    else:
        mm(tokens, h, q_local + 2 * kv_local)
        mm(tokens, q_local, h)
    # attention core: QK^T and PV over the whole sequence (ring CP visits every key block)
    v_dim = model.v_head_dim if model.is_mla else hd
    qk_dim = hd + (model.qk_rope_head_dim if model.is_mla else 0)
    core_flops = 2.0 * tokens * seq_len * heads_local * (qk_dim + v_dim)
    attn_rate = rates.attn_flops * head_dim_factor((qk_dim + v_dim) / 2)
    if arch.flash:
        if causal_skip:
            core_flops *= 0.5  # causal blocks above the diagonal are skipped
        # the keys one kernel call gives a query block (a ring's call sees one peer's chunk), and the
        # block's fixed work on top of scoring them (HardwareSpec.attention_fixed_keys)
        keys = seq_len if layout.cp == 1 or layout.cp_impl == "ulysses" else seq_len / layout.cp
        visited = keys / 2 if causal_skip else keys
        core = core_flops / attn_rate * (1 + rates.fixed_keys / visited)
        core_bwd = 2.5 * core
        core_stream = 0.0
    else:  # scores materialised: fused scale-mask-softmax (r+w) and dropout (r+w+mask) on a·s·s
        core = core_flops / attn_rate
        core_bwd = 2.0 * core
        core_stream = rates.stream(9 * heads_local * tokens * seq_len)
    flops += core_flops
    # MLP
    if moe:
        k, fe, experts_local = model.experts_per_token, model.expert_ffn_hidden, model.experts / layout.ep
        routed_tokens = tokens * k  # balanced routing: each rank's experts see k·T tokens
        per_expert = routed_tokens / experts_local
        # fivefold's MoE block is not tensor-parallel (every tp rank runs it whole on all the tokens);
        # with expert tensor parallelism (published runs) the experts' ffn dim is split over tp
        etp = tp if arch.expert_tp else 1
        mm(per_expert, h, 2 * fe / etp, experts_local)
        mm(per_expert, fe / etp, h, experts_local)
        if model.shared_experts:
            fs = model.shared_experts * fe
            mm(tokens, h, 2 * fs / etp)
            mm(tokens, fs / etp, h)
        mm(tokens, h, model.experts)  # router
        act_elems = routed_tokens * fe / etp + tokens * model.shared_experts * fe / etp
        permute = 2 * 2 * routed_tokens * h * BYTES  # gather to experts and scatter back
    else:
        f = model.ffn_hidden
        mm(tokens, h, (2 if arch.gated_mlp else 1) * f / tp)
        mm(tokens, f / tp, h)
        act_elems = tokens * f / tp
        permute = 0.0
    # elementwise traffic (bytes): two norms (r+w), two residual adds (or bias-dropout-adds),
    # the MLP activation, rotary embedding on q and k
    stream = 2 * 4 * norm_tokens * h
    stream += 2 * (7 if arch.dropout else 6) * norm_tokens * h
    stream += (6 if arch.gated_mlp or moe else 4) * act_elems
    if not arch.dropout:
        stream += 4 * tokens * (q_local + kv_local)
    stream += permute
    if not fused:  # eager PyTorch: every norm, activation and rotary op is its own kernel
        stream *= EAGER_TRAFFIC
    elementwise = rates.stream(stream) + core_stream
    reorder = 0.0
    if layout.cp > 1 and layout.cp_impl == "ulysses":
        # Ulysses' all-to-alls change layout: q, k, v and the output are each copied about three times
        # a pass (the contiguous send buffer, the received layout, the sequence order), read and written
        reorder = rates.stream(3 * 2 * BYTES * tokens * (2 * q_local + 2 * kv_local))
    # a CPU host's per-op work (dispatch, autograd), in series and not threaded: twice the ops backward
    fwd = gemm_fwd + core + elementwise + reorder + rates.block_dispatch
    bwd = 2 * gemm_fwd + core_bwd + 2 * elementwise + reorder + 2 * rates.block_dispatch
    ffn = model.expert_ffn_hidden * model.experts_per_token if moe else model.ffn_hidden
    mlp_mats = 3 if (arch.gated_mlp or moe) else 2
    skipped = (kv_local + q_local + ffn / tp) / (2 * q_local + 2 * kv_local + mlp_mats * ffn / tp)
    op_redo = gemm_fwd * skipped + elementwise
    return LayerTime(
        fwd=fwd, bwd=bwd, attn_core_fwd=core + core_stream, wgrad=gemm_fwd, flops_fwd=flops, op_redo=op_redo
    )


def head_time(
    model: ModelSpec, layout: Layout, micro_batch: int, seq_len: int, rates: Rates
) -> tuple[float, float]:
    """(forward, backward) seconds of the output head and the cross-entropy loss (vocab split by tp)."""
    tokens = micro_batch * seq_len / layout.cp
    vocab_local = model.vocab / layout.tp
    fwd = rates.gemm(tokens, model.hidden, vocab_local) + rates.stream(10 * tokens * vocab_local)
    bwd = 2 * rates.gemm(tokens, model.hidden, vocab_local) + rates.stream(8 * tokens * vocab_local)
    # the embedding, final norm, head and loss: about a block's worth of ops on a CPU host
    return fwd + rates.block_dispatch, bwd + 2 * rates.block_dispatch


def step_overhead(hw: HardwareSpec, gpus: int) -> float:
    """Seconds a step of `gpus` ranks spends on its synchronisation: the knob (its value at 64 GPUs)
    scaled by the reduction tree's depth, log2(gpus) / log2(64); none on one GPU."""
    knob = hw.step_overhead_s or DEFAULT_STEP_OVERHEAD_S
    return knob * math.log2(max(gpus, 1)) / math.log2(OVERHEAD_REFERENCE_GPUS)


FP32_ACCUMULATE_BYTES = 10  # a separate fp32 accumulation: read the 16-bit gradient, read and write fp32


def accumulate_pass_time(local_params: float, micro_batches: int, rates: Rates) -> float:
    """Seconds of a trainer's separate fp32 gradient accumulation (`TrainShape.fp32_accumulate_pass`):
    every local parameter's gradient streamed once after each micro-batch's backward."""
    return micro_batches * FP32_ACCUMULATE_BYTES * local_params / rates.hbm


def optimizer_time(
    local_params: float, rates: Rates, hw: HardwareSpec | None = None, offload: bool = False, gpus: int = 1
) -> float:
    """Adam over the parameters this rank updates (a memory-bound stream), plus the step's
    synchronisation overhead for `gpus` ranks when `hw` is given. Offloaded, the gradients go down
    and the 16-bit weights come back over PCIe and the host streams the update."""
    overhead = step_overhead(hw, gpus) if hw is not None else 0.0
    if offload:
        moved = local_params * (4 + BYTES) / HOST_LINK_BPS
        return moved + OPTIMIZER_BYTES_PER_PARAM * local_params / HOST_MEMORY_BPS + overhead
    return rates.stream(OPTIMIZER_BYTES_PER_PARAM * local_params) + overhead
