"""What the planner is asked about: the training shape, the block style, and per-rank parameter counts.

The model's parameter count comes from `ModelSpec.num_params`; the only correction is for the classic
GPT block (two-matrix GeLU MLP, tied embeddings), which ModelSpec (a Llama-style SwiGLU block)
would otherwise overcount.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.errors import FivefoldError, divisors, suggest

BLOCKS = ("auto", "llama", "gpt")
ATTENTION = ("flash", "flash3", "materialized")


@dataclass(frozen=True)
class TrainShape:
    """One optimizer step: sequence length, batch sizes (in sequences) and state precisions (bytes)."""

    seq_len: int
    global_batch: int
    micro_batch: int = 1
    param_bytes: int = 2  # 16-bit weights used by the matmuls
    act_bytes: int = 2  # an activation element: 2 in 16-bit training, 4 in fp32 (fivefold's CPU default)
    grad_bytes: int = 4  # fp32 gradient accumulation (Megatron main grads, FSDP2 reduce dtype)
    optimizer_bytes: int = 12  # fp32 master weights + Adam first and second moments
    block: str = "auto"  # auto | llama | gpt (see Arch)
    overlap_grad_reduce: bool = True  # data-parallel gradient reduction overlaps the last backward
    # flash (FlashAttention-2 class) | flash3 (Hopper-native: FlashAttention-3, cuDNN fused attention)
    # | materialized (the s×s scores kept, as the 2021-22 Megatron kernels)
    attention: str = "flash"
    tp_overlap: bool = False  # tp collectives overlapped with the matmuls (TE comm overlap, async TP)
    # with tp_overlap, the backward's reduce-scatters are overlapped too (Transformer Engine's); torch's
    # micro-pipelined TP fuses a scatter only with the one matmul feeding it, and the backward's take the
    # sum of several (q, k, v; w1, w3), so only its gathers of the output gradient are hidden there
    tp_overlap_backward_scatters: bool = True
    # fused elementwise kernels (Megatron/TE, torch.compile); False: eager PyTorch, fivefold's runtime
    # without --compile (each norm, activation and rotary op its own kernel)
    fused: bool = False
    # saved activations as fivefold's eager model code keeps them (each norm's fp32 input and
    # reciprocal RMS, SwiGLU's activated gate, rotary q and k; `fivefold.plan.activations`), the
    # runtime without --compile; False: what fused kernels keep (Korthikanti et al.; published trainers)
    saved_as_eager: bool = True
    # fp32 weights that are their own master copy, cast to the compute dtype per matmul (autocast) or
    # per gather (FSDP2's and replicate's mixed precision), FSDP sharding them at zero 2 as at 3:
    # fivefold's runtime; False: 16-bit weights beside an fp32 master in the optimizer (Megatron, the
    # ZeRO paper's accounting), the published trainers
    fp32_weights: bool = True
    fp8: bool = False  # matmuls in fp8 (Transformer Engine / torchao float8 linears), the rest in 16 bits
    # fused cross-entropy (FlashAttention's xentropy kernel, llm-foundry's default): only the 16-bit
    # logits are kept and their gradient is written in place; otherwise an fp32 copy is kept as well
    fused_loss: bool = False
    # ZeRO-3 as torch FSDP and JAX run it: the fp32 shard is the parameter and the master weight at
    # once (16-bit copies exist only gathered); DeepSpeed keeps a separate 16-bit shard
    fp32_shard: bool = True
    # routed and shared experts split over tp as well (Megatron's expert tensor parallelism, as
    # published runs use); fivefold's runtime keeps the MoE block whole on every tp rank
    expert_tp: bool = False
    # ZeRO-3's unsharded working set in parameters: 0 means whole blocks (FSDP wraps a transformer
    # block per unit and prefetches the next); DeepSpeed gathers sub-modules up to its
    # `stage3_max_live_parameters` (1e9 by default) instead
    live_params: float = 0.0
    # with sub-module gathering, a parameter next used more than this many parameters later is
    # released and gathered again (DeepSpeed's `stage3_max_reuse_distance`, 1e9 by default)
    reuse_distance: float = 0.0
    # optimizer state (fp32 master + moments) kept in host memory and stepped on the CPU
    # (DeepSpeed ZeRO-Offload, FSDP2's CPUOffloadPolicy); only published runs set it
    offload_optimizer: bool = False
    # under full recompute, the checkpointed layer inputs kept in host memory too (DeepSpeed's
    # cpu_checkpointing); only published runs set it
    offload_checkpoints: bool = False
    # what `selective` recompute keeps: "attention" (Megatron's and fivefold's: everything but the
    # attention core) or "op" (torchtitan's per-op policy: matmul outputs but every second one, and
    # attention outputs; norms, activations and the other matmuls are redone); published runs only
    sac: str = "attention"
    # ZeRO-2 as DeepSpeed runs it: weights stay whole between micro-batches (only the step's update is
    # gathered, once); FSDP's zero 2 regathers them for every micro-batch outside a pipeline
    params_kept: bool = False
    # sequence parallelism as Megatron runs it: a column-parallel matmul keeps its input sharded and
    # gathers it again in the backward for the weight gradient (two more all-gathers a layer), and the
    # norms' partial gradients are summed over tp in one call; DTensor (fivefold, torchtitan) keeps
    # the gathered input and sums each norm's gradient on its own. Published Megatron-family runs set it
    tp_regather: bool = False
    # activations sharded over tp whatever the sequence length: XLA's partitioner pads a short shard or
    # splits another dimension, where fivefold's DTensor (and Megatron) need tp to divide each sequence
    sp_any_length: bool = False
    # the input-gradient collective of a tp matmul runs beside its weight-gradient matmul (Megatron's
    # asynchronous grad-input communication); DTensor's (fivefold's, torchtitan's eager) is waited on
    # by the next op of the backward. Published Megatron-family runs set it
    tp_backward_overlap: bool = False
    # ring context parallelism's gradient buffer for K and V travels in fp32 (fivefold's ring); the
    # published runs' rings send it in the activations' dtype
    ring_grad_fp32: bool = True
    # plain data parallelism's gradient buckets as torch DDP rebuilds them after the first step (the
    # first 1 MiB, then 25 MiB each: fivefold's runtime); published runs: Megatron's, grown with the
    # group so that a large ring's latency stays amortised
    torch_ddp_buckets: bool = True
    # context parallelism's attention skips the key blocks above the causal diagonal (published
    # rings, load-balanced); fivefold's ring and all-gather cores compute them under a mask
    cp_causal_skip: bool = False
    # with a sharded optimizer (ZeRO >= 1) the gradient reduction and the updated shards' gather still
    # run beside compute; nanotron's builds no DDP then and reduces after the backward (published runs)
    sharded_overlap: bool = True
    # with a sharded optimizer the whole gradient is all-reduced rather than reduce-scattered, and the
    # updated weights come back through one slice and one copy per parameter tensor and data rank,
    # issued one by one from the host (nanotron's ZeRO-1: sync_gradients_across_dp, all_gather_coalesced)
    sharded_copies: bool = False
    # ZeRO-1 as torch's ZeroRedundancyOptimizer runs it (fivefold's runtime): DDP all-reduces the whole
    # gradient, and after the step each rank broadcasts the parameters it owns, one tensor at a time;
    # Megatron's distributed optimizer reduce-scatters and all-gathers instead
    zero1_broadcasts: bool = True
    # gradients accumulate in fp32 through a separate add after each micro-batch's backward (read the
    # 16-bit gradient, read and write the fp32 one), not fused into the weight-gradient matmul as
    # Megatron's gradient_accumulation_fusion does (nanotron's FP32GradientAccumulator)
    fp32_accumulate_pass: bool = False
    # parameter tensors of a block (norms included): per-tensor host work is counted with it. fivefold's
    # Llama block: q, k, v, o, w1, w2, w3 and two norms; nanotron fuses qkv and gate-up (6)
    block_tensors: int = 9
    # without sequence parallelism each tp rank still sends only its 1/tp of a stage's activation and
    # the receivers all-gather it over the fast link (Megatron's scatter-gather, on by default since
    # 2021; DeepSpeed's pipe_partitioned); fivefold's runtime sends the whole tensor from every tp rank
    pp_scatter: bool = False
    # a pipeline's stage hand-overs block the compute stream, every micro-batch (DeepSpeed's pipeline
    # engine: its p2p.send and recv take no async_op), instead of running beside the next compute
    p2p_blocking: bool = False
    # with a pipeline the data-parallel gradient reduction runs after the whole schedule, not beside
    # the last backward (DeepSpeed's pipeline engine turns its backward all-reduce off and issues
    # ReduceGrads once the schedule ends)
    reduce_after_pipeline: bool = False
    # fivefold's pipeline runner: plain data replicas (no fsdp, no tp) average each gradient tensor
    # with its own all-reduce once the schedule has run (`PipelineRunner._average_replica_grads`)
    replica_grads_per_tensor: bool = True

    @property
    def dtype(self) -> str:
        """The compute dtype's name, as a run and the exact count (`fivefold.plan.activations`) say it."""
        return "bf16" if self.act_bytes == 2 else "fp32"

    def validate(self) -> TrainShape:
        for name in ("seq_len", "global_batch", "micro_batch"):
            if getattr(self, name) <= 0:
                raise FivefoldError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.block not in BLOCKS:
            raise FivefoldError(f"--block must be one of {', '.join(BLOCKS)}, got {self.block!r}")
        if self.attention not in ATTENTION:
            raise FivefoldError(f"--attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        return self

    def on(self, hw: HardwareSpec) -> TrainShape:
        """This shape as the device can run it: without FlashAttention-class kernels (pre-Ampere
        GPUs) attention materialises its scores."""
        if not hw.flash_attention and self.attention != "materialized":
            return dataclasses.replace(self, attention="materialized")
        return self

    def microbatches(self, layout: Layout) -> int:
        """Micro-batches per data-parallel rank per step (the pipeline's m)."""
        per = self.micro_batch * layout.dp * layout.fsdp
        if self.global_batch % per:
            ok = [per * k for k in range(1, 9)]
            data = layout.dp * layout.fsdp
            sizes = divisors(self.global_batch // data) if self.global_batch % data == 0 else []
            hint = f"; or --micro-batch in {suggest(sizes)}" if sizes else ""
            raise FivefoldError(
                f"--global-batch {self.global_batch} must be a multiple of micro_batch × data-parallel ranks "
                f"(dp×fsdp) = {self.micro_batch}×{layout.dp * layout.fsdp} = {per}; "
                f"valid: {suggest(ok)}{hint}"
            )
        return self.global_batch // per


@dataclass(frozen=True)
class Arch:
    """Implementation facts that change memory and time but are not in the model's shape.

    `gpt`: the GPT block: two-matrix GeLU MLP, LayerNorm, tied embeddings.
    `llama`: SwiGLU, RMSNorm, rotary embeddings.
    `auto` picks gpt for a dense multi-head model whose MLP is exactly 4·hidden (GPT-2/3, OPT,
    BLOOM, MT-NLG, MPT, Megatron's tables), llama otherwise.
    The attention kernel is a separate fact of the run: FlashAttention unless `materialized` is
    asked for (the 2021-22 Megatron kernels, which also apply dropout to the scores and residuals).
    """

    name: str
    gated_mlp: bool
    dropout: bool
    flash: bool
    tied: bool
    expert_tp: bool = False  # see TrainShape.expert_tp


def resolve_arch(
    model: ModelSpec, block: str = "auto", attention: str = "flash", expert_tp: bool = False
) -> Arch:
    # a model that says its MLP is GELU's (GPT-2, NeoX, Falcon) is a GPT block, tied only where it says
    stated_gpt = block == "auto" and model.mlp == "gelu"
    if block == "auto":
        classic = (
            not model.is_moe
            and not model.is_mla
            and model.kv_heads == model.heads
            and model.ffn_hidden == 4 * model.hidden
        )
        block = "gpt" if classic or stated_gpt else "llama"
    flash = attention != "materialized"
    if block == "gpt":
        tied = model.tie_embeddings if stated_gpt else True
        return Arch("gpt", gated_mlp=False, dropout=not flash, flash=flash, tied=tied, expert_tp=expert_tp)
    tied = model.tie_embeddings
    return Arch("llama", gated_mlp=True, dropout=not flash, flash=flash, tied=tied, expert_tp=expert_tp)


# said of a plan whose `auto` block read a multi-head, 4·hidden model as GPT's (the published runs of that
# shape are), where fivefold's own model code builds a SwiGLU block of it
GPT_GUESS_NOTE = (
    "planned as a GPT block (a multi-head model with a 4·hidden MLP: two GeLU matrices); "
    "fivefold {command} builds SwiGLU blocks of it (three matrices): --block llama plans what it runs"
)


def gpt_block_guessed(model: ModelSpec, arch: Arch, block: str) -> bool:
    """Whether `auto` planned a GPT block for a model fivefold's runtime builds with a SwiGLU MLP."""
    return block == "auto" and arch.name == "gpt" and model.mlp == "swiglu"


def mlp_params(model: ModelSpec, arch: Arch) -> int:
    return (3 if arch.gated_mlp else 2) * model.hidden * model.ffn_hidden


def total_params(model: ModelSpec, arch: Arch) -> int:
    """All parameters (ModelSpec's count, corrected for a GPT block's MLP and tied embeddings)."""
    n = model.num_params()
    if not arch.gated_mlp:
        n -= (model.layers - model.moe_layers) * model.hidden * model.ffn_hidden
    if arch.tied and not model.tie_embeddings:
        n -= model.vocab * model.hidden
    return n


def matmul_params(model: ModelSpec, arch: Arch) -> int:
    """Weights a token multiplies in one forward pass (active experts, the output head, no gather)."""
    from fivefold.flops import matmul_params_per_token

    n = matmul_params_per_token(model)
    if not arch.gated_mlp:
        n -= (model.layers - model.moe_layers) * model.hidden * model.ffn_hidden
    return n


def kv_heads_local(model: ModelSpec, tp: int) -> float:
    """Key/value heads on one tp rank: their share, and at least one whole head (a head is
    replicated over tp / kv_heads ranks where tp > kv_heads)."""
    return max(model.kv_heads / tp, 1.0)


def block_modules(model: ModelSpec, arch: Arch, layout: Layout) -> list[float] | None:
    """Parameters of a dense block's sub-modules on one rank, in forward order, as Megatron builds
    them: fused q·k·v, the output projection, the MLP's input (gate and up fused), its output. They
    add up to `layer_shard`'s dense share (K/V heads kept whole where tp > kv_heads). None for blocks
    of another make (experts, latent attention)."""
    if model.is_moe or model.is_mla:
        return None
    h, d, tp = model.hidden, model.head_dim, layout.tp
    kv_local = kv_heads_local(model, tp)
    out_proj = model.heads * d * h / tp
    mlp_out = model.ffn_hidden * h / tp
    return [out_proj + 2 * kv_local * d * h, out_proj, mlp_params(model, arch) / tp - mlp_out, mlp_out]


@dataclass(frozen=True)
class LayerShard:
    """Parameters of one transformer layer held by one rank, split by how they are sharded."""

    dense: float  # attention + dense MLP (+ shared experts), after tensor parallelism
    experts: float  # routed experts, after expert and tensor parallelism
    replicated: float  # norms and router: the same on every tp rank


def layer_shard(model: ModelSpec, arch: Arch, layout: Layout, moe: bool) -> LayerShard:
    h, d, tp = model.hidden, model.head_dim, layout.tp
    if model.is_mla:
        attn = model.attention_params() / tp
    else:
        kv_local = kv_heads_local(model, tp)
        attn = (2 * model.heads * d * h) / tp + 2 * kv_local * d * h
    norms = 2 * h
    if moe:  # fivefold keeps the MoE block whole on every tp rank (experts split over ep only)
        etp = tp if arch.expert_tp else 1
        shared = model.shared_experts * model.expert_params() / etp
        routed = model.experts * model.expert_params() / (layout.ep * etp)
        return LayerShard(attn + shared, routed, norms + h * model.experts)
    return LayerShard(attn + mlp_params(model, arch) / tp, 0.0, norms)
