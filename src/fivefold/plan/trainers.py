"""What the trainers behind published runs do when a run does not say: facts about the frameworks
(their kernels, overlaps, bucket and gather policies), read in their code and documentation, and the
TrainShape fields they set. The runs reader (`fivefold.plan.runs`) and `fivefold plan --trainer` read
the same table."""

from __future__ import annotations

import dataclasses
import re
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fivefold.config import Layout
    from fivefold.plan.spec import TrainShape

# What the trainer behind a source does when a run does not say (facts about the frameworks):
# NeMo / Megatron-core with Transformer Engine fuses its elementwise kernels and, in its performance
# recipes, overlaps the tp collectives with the matmuls, on Hopper runs cuDNN's fused attention, and
# reduces gradients in bf16 (Megatron-core's grad_reduce_in_fp32 defaults to off); torchtitan runs
# eager PyTorch unless torch.compile is stated. Others: fused kernels, no tp overlap.
# the pipeline schedules Megatron-core runs: 1F1B, and 1F1B over virtual stages
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")
# DeepSpeed's pipeline engine (runtime/pipe): its stage hand-overs are blocking sends and receives
# (p2p.send asserts async_op is False), and it turns the backward's gradient all-reduce off to issue
# one ReduceGrads after the schedule
DEEPSPEED_PIPELINE = {"p2p_blocking": True, "reduce_after_pipeline": True}
TRAINERS = {
    "NVIDIA/NeMo": {
        "fused": True,
        "tp_overlap": True,
        "attention": "flash3",
        "grad_bytes": 2,
        "schedules": MEGATRON_SCHEDULES,
    },
    "NVIDIA/dgxc-benchmarking": {
        "fused": True,
        "tp_overlap": True,
        "attention": "flash3",
        "grad_bytes": 2,
        "schedules": MEGATRON_SCHEDULES,
    },
    "NVIDIA/Megatron-LM": {"schedules": MEGATRON_SCHEDULES},
    # torchtitan splits a pipeline's local batch into pp micro-batches unless told otherwise, and its
    # sequence parallelism is DTensor's (the gathered matmul input kept for the backward)
    "pytorch/torchtitan": {
        "fused": False,
        "tp_overlap": False,
        # its async TP is torch's micro-pipelined TP (Inductor's micro_pipeline_tp pass): the backward's
        # reduce-scatters, fed by a sum of matmuls, are not fused (pytorch PR 149946)
        "tp_overlap_backward_scatters": False,
        "microbatches": "pp",
        "virtual_stages": 2,  # its looped schedules build two stages a rank unless told otherwise
        "tp_regather": False,
        "tp_backward_overlap": False,
        # its attention is torch's SDPA: FlashAttention-2 in its published runs (before torch 2.11), cuDNN's
        # under a torch_version that prefers it (`sdpa_attention`)
        "sdpa": True,
    },
    # loss_fn = fused_crossentropy by default; Composer's FSDP has no pipeline
    "mosaicml/llm-foundry": {"fused_loss": True, "schedules": ()},
    # its xentropy kernel, in-place backward; its own attention kernel since its first release (2022)
    "Dao-AILab/flash-attention": {"fused_loss": True, "attention": "flash"},
    # ZeRO-3 keeps fp16 shards beside the fp32 master and gathers sub-modules up to
    # stage3_max_live_parameters (1e9 by default), not whole blocks, and releases those next used
    # more than stage3_max_reuse_distance (1e9) parameters later. Its gradients are the 16-bit
    # parameters' own, reduced in that dtype (communication_data_type defaults to the model's; only
    # the optimizer's partition is fp32)
    "microsoft/DeepSpeed": {
        "fp32_shard": False,
        "live_params": 1e9,
        "reuse_distance": 1e9,
        "grad_bytes": 2,
        "schedules": ("1f1b",),
        "zero_with_pipeline": 1,
        **DEEPSPEED_PIPELINE,
    },
    # nanotron's pipeline engines are all-forward-all-backward and 1F1B: no interleaved chunks. With
    # its sharded optimizer and fp32 gradient accumulation (what its benchmark sweep sets) it builds
    # no DDP: the gradients are reduce-scattered after the backward, and the updated shards gathered
    # after the step, neither beside compute (trainer.py's make_ddp, sync_gradients_across_dp)
    # The sharded optimizer all-reduces the whole fp32 gradient ("too memory hungry" to reduce-scatter,
    # trainer.py) and gathers the updated weights by slicing and copying every parameter tensor for
    # every data rank in Python (distributed.py's all_gather_coalesced); fp32 accumulation is an add
    # per parameter after every micro-batch's backward (FP32GradientAccumulator). Its Llama fuses
    # q, k, v and gate-up: 6 tensors a block
    "huggingface/nanotron": {
        "sharded_overlap": False,
        "sharded_copies": True,
        "fp32_accumulate_pass": True,
        "block_tensors": 6,
        "schedules": ("1f1b", "gpipe"),  # its 1F1B and all-forward-all-backward engines
        "max_zero": 1,  # its optimizer shards the state (ZeRO-1) at most
    },
    # Megatron's model and kernels under DeepSpeed's pipeline engine, which runs 1F1B only (no
    # interleaved chunks) and, with a pipeline, shards no more than the optimizer state (ZeRO-1: its
    # stages 2 and 3 refuse pipeline parallelism). BLOOM and MT-NLG were trained with it. Megatron's
    # sequence parallelism and selective recompute reached it with its mid-2023 rebase on Megatron-LM
    "microsoft/Megatron-DeepSpeed": {
        "zero_with_pipeline": 1,
        "sp_since": 2023,
        "schedules": ("1f1b",),
        **DEEPSPEED_PIPELINE,
    },
    # fivefold's own run directories (`framework = "fivefold"`): DTensor's sequence parallelism
    "fivefold": {
        "fused": False,  # eager model code (a run's torch_compile says otherwise)
        "pp_scatter": False,
        "tp_regather": False,
        "tp_backward_overlap": False,
        "ring_grad_fp32": True,
        "torch_ddp_buckets": True,
        "cp_causal_skip": False,
        "zero1_broadcasts": True,  # its ZeRO-1 is torch's ZeroRedundancyOptimizer
        "saved_as_eager": True,  # its eager model code's saved tensors (torch.compile's: run facts)
        "expert_tp": False,  # its MoE block runs whole on every tp rank
        "fp32_weights": True,  # fp32 weights, their own master, cast for the compute
        "replica_grads_per_tensor": True,  # its pipeline's replicas: one all-reduce a gradient, after
        "sdpa": True,  # its attention is torch's SDPA (`sdpa_attention`)
    },
}
# `fivefold plan --trainer NAME`: the trainer whose facts a plan takes (fivefold's own by default)
TRAINER_FLAGS = {
    "fivefold": "fivefold",
    "megatron": "NVIDIA/Megatron-LM",
    "nemo": "NVIDIA/NeMo",
    "torchtitan": "pytorch/torchtitan",
    "deepspeed": "microsoft/DeepSpeed",
    "megatron-deepspeed": "microsoft/Megatron-DeepSpeed",
    "nanotron": "huggingface/nanotron",
    "llm-foundry": "mosaicml/llm-foundry",
}


def trainer_facts(name: str, hopper: bool) -> dict[str, Any]:
    """A trainer's facts (TRAINERS[name]) with what its Hopper-era runs add: Megatron-LM through
    Transformer Engine (cuDNN's fused attention, tp collectives overlapped with the GEMMs)."""
    trainer = TRAINERS.get(name, {})
    if name == "NVIDIA/Megatron-LM" and hopper:
        # Megatron-LM's Hopper-era runs go through Transformer Engine like NeMo's and dgxc's (the same
        # Megatron-Core): cuDNN's fused attention, and tp collectives overlapped with the GEMMs
        # (--tp-comm-overlap, which its published H100 scaling runs use)
        trainer = {**trainer, "attention": "flash3", "tp_overlap": True}
    return trainer


# torch's SDPA (fivefold's attention, torchtitan's) runs cuDNN's fused attention (FlashAttention-3 class)
# by default on Hopper and newer from torch 2.11: 2.9 prefers it there once the bundled cuDNN is past 9.15,
# and 2.11's wheels are. On an H200 with torch 2.11 the causal training call ran cuDNN's sm90 kernels at
# 2.3-2.6 times the rate of SDPA's FlashAttention-2 backend (benchmarks/bench_gpu.md).
SDPA_CUDNN_SINCE = (2, 11)


def installed_torch() -> str:
    """The version of the torch installed here ("" without one): what fivefold's runtime would run."""
    try:
        return version("torch")
    except PackageNotFoundError:
        return ""


def sdpa_attention(hopper: bool, torch_version: str | None = None) -> str:
    """The kernel torch's SDPA runs on this GPU under `torch_version` (default: the installed torch):
    cuDNN's (flash3) where SDPA prefers it, else FlashAttention-2 class (flash)."""
    numbers = re.match(r"(\d+)\.(\d+)", installed_torch() if torch_version is None else torch_version)
    cudnn = numbers is not None and (int(numbers[1]), int(numbers[2])) >= SDPA_CUDNN_SINCE
    return "flash3" if hopper and cudnn else "flash"


def runtime_kernel(shape: TrainShape, gpu: str) -> TrainShape:
    """`shape` with the attention kernel fivefold's runtime runs on `gpu` (its SDPA's, `sdpa_attention`);
    materialised scores, asked for, stay."""
    if shape.attention == "materialized":
        return shape
    return dataclasses.replace(shape, attention=sdpa_attention(hopper_or_newer(gpu)))


def kernel_on(attention: str, hopper: bool) -> str:
    """The attention kernel a trainer runs on this GPU: FlashAttention-3 class kernels (cuDNN's fused
    attention) exist on Hopper and newer only; before, the same trainer runs FlashAttention-2 class."""
    return "flash" if attention == "flash3" and not hopper else attention


def shape_facts(trainer: dict[str, Any]) -> dict[str, Any]:
    """The TrainShape fields a trainer's facts set, with the defaults of a trainer we know nothing of
    (Megatron's behaviour); fivefold's own entry gives its runtime's."""
    return {
        "fused": bool(trainer.get("fused", True)),
        "grad_bytes": int(trainer.get("grad_bytes", 4)),
        "tp_overlap": bool(trainer.get("tp_overlap", False)),
        "tp_overlap_backward_scatters": bool(trainer.get("tp_overlap_backward_scatters", True)),
        "fused_loss": bool(trainer.get("fused_loss", False)),
        "fp32_shard": bool(trainer.get("fp32_shard", True)),
        "live_params": float(trainer.get("live_params", 0.0)),
        "reuse_distance": float(trainer.get("reuse_distance", 0.0)),
        # Megatron's sequence parallelism (and its descendants'), unless the trainer is DTensor's
        "tp_regather": bool(trainer.get("tp_regather", True)),
        "tp_backward_overlap": bool(trainer.get("tp_backward_overlap", True)),
        "ring_grad_fp32": bool(trainer.get("ring_grad_fp32", False)),
        "torch_ddp_buckets": bool(trainer.get("torch_ddp_buckets", False)),
        "cp_causal_skip": bool(trainer.get("cp_causal_skip", True)),
        "sharded_overlap": bool(trainer.get("sharded_overlap", True)),
        "sharded_copies": bool(trainer.get("sharded_copies", False)),
        "zero1_broadcasts": bool(trainer.get("zero1_broadcasts", False)),
        "saved_as_eager": bool(trainer.get("saved_as_eager", False)),
        "fp32_weights": bool(trainer.get("fp32_weights", False)),
        "fp32_accumulate_pass": bool(trainer.get("fp32_accumulate_pass", False)),
        "block_tensors": int(trainer.get("block_tensors", 9)),
        "sp_any_length": bool(trainer.get("sp_any_length", False)),
        "pp_scatter": bool(trainer.get("pp_scatter", True)),
        "p2p_blocking": bool(trainer.get("p2p_blocking", False)),
        "reduce_after_pipeline": bool(trainer.get("reduce_after_pipeline", False)),
        "replica_grads_per_tensor": bool(trainer.get("replica_grads_per_tensor", False)),
    }


def trainer_refuses(trainer: dict[str, Any], layout: Layout) -> str | None:
    """Why a trainer (its TRAINERS facts) cannot run `layout`, or None: a pipeline schedule it lacks,
    more ZeRO than it shards, or more than it shards beside a pipeline. A trainer we know nothing of
    refuses nothing."""
    schedules = trainer.get("schedules")
    if layout.pp > 1 and schedules is not None and layout.pp_schedule not in schedules:
        runs = ", ".join(schedules) if schedules else "no pipeline"
        return f"--pp-schedule {layout.pp_schedule} (it runs {runs})"
    with_pipeline = layout.pp > 1 and trainer.get("zero_with_pipeline", 3) < trainer.get("max_zero", 3)
    cap = trainer.get("zero_with_pipeline", 3) if with_pipeline else trainer.get("max_zero", 3)
    if layout.zero > cap or (cap < 2 and layout.fsdp > 1):  # fsdp shards what ZeRO-1 keeps whole
        beside = " beside a pipeline" if with_pipeline else ""
        return f"--zero {layout.zero} with --fsdp {layout.fsdp} (it shards at most ZeRO-{cap}{beside})"
    return None


# FlashAttention appeared in mid-2022 and reached Megatron (--use-flash-attn) and DeepSpeed in 2023:
# runs published up to 2022 (Megatron SC21, Korthikanti et al., BLOOM, Megatron-DeepSpeed's ZeRO-3
# scaling) ran attention kernels that materialise the scores, unless the run or its trainer says
LAST_MATERIALIZED_YEAR = 2022
# Fused bias-GELU and scale-mask-softmax kernels (Megatron-LM's, through torch.jit and its own CUDA) came
# in 2020: before, each elementwise op of a block was its own kernel
LAST_UNFUSED_YEAR = 2019
# Megatron's sequence parallelism (Korthikanti et al., May 2022): a run published before it (or before
# its trainer took it up: `sp_since`) had none, unless it says
FIRST_SP_YEAR = 2022


# A runs file from elsewhere names its trainer in its own words ("... Megatron-LM baseline",
# framework = "torchtitan"): the first of these a source or framework names is the trainer.
# Megatron-DeepSpeed first: Megatron's kernels with DeepSpeed's ZeRO-1 and pipeline engine.
TRAINER_WORDS = (
    (r"dgxc", "NVIDIA/dgxc-benchmarking"),
    (r"\bnemo\b", "NVIDIA/NeMo"),
    # BigScience trained BLOOM with its Megatron-DeepSpeed fork; EleutherAI's GPT-NeoX is Megatron's model on
    # DeepSpeed's pipeline engine too
    (r"megatron[- ]?deepspeed|bigscience|gpt-neox", "microsoft/Megatron-DeepSpeed"),
    (r"megatron", "NVIDIA/Megatron-LM"),
    (r"torchtitan", "pytorch/torchtitan"),
    (r"llm-foundry|mosaicml|\bcomposer\b", "mosaicml/llm-foundry"),
    (r"nanotron", "huggingface/nanotron"),
    (r"deepspeed", "microsoft/DeepSpeed"),
    (r"flash-attention", "Dao-AILab/flash-attention"),
)
# FlashAttention-3 (July 2024) and cuDNN's fused attention in Transformer Engine: Hopper runs from then
FIRST_FLASH3_YEAR = 2024


def named_trainer(text: str) -> str | None:
    """The trainer a source or framework names in its own words (TRAINER_WORDS), or None."""
    low = text.lower()
    return next((name for pattern, name in TRAINER_WORDS if re.search(pattern, low)), None)


HOPPER_OR_NEWER = ("H100", "H200", "H800", "H20", "HOPPER", "B200", "B100")


def hopper_or_newer(gpu: str) -> bool:
    """Whether a GPU, named as a run describes it or as a preset is called, is Hopper or newer (the
    GPUs with Hopper-native attention kernels)."""
    return any(k in gpu.upper() for k in HOPPER_OR_NEWER)


XLA_FRAMEWORKS = ("jax", "xla", "maxtext", "t5x", "pax", "lingvo", "tensorflow")


def runs_on_xla(framework: str, gpu: str = "") -> bool:
    """Whether a run compiles through XLA: its stated framework does (JAX: MaxText, PaLM's stack;
    TensorFlow), or it ran on TPUs, which nothing else drives."""
    return any(word in framework.lower() for word in XLA_FRAMEWORKS) or "TPU" in gpu.upper()


def published_trainer(
    name: str, gpu: str, framework: str, year: int | None, torch_version: str | None = None
) -> tuple[dict[str, Any], str]:
    """(facts, attention kernel) of trainer `name` (a TRAINERS key, or a source with no known facts)
    on the GPU a run names, in the framework it names, in the year it was published; fivefold's own
    runs under the torch they ran with (`torch_version`; unstated: the installed one)."""
    hopper = hopper_or_newer(gpu)
    trainer = trainer_facts(name, hopper)
    if trainer.get("sdpa") and (torch_version is not None or name == "fivefold"):
        # SDPA's kernel by the torch the run names (fivefold's own runs: else the one installed here)
        return trainer, sdpa_attention(hopper, torch_version)
    if runs_on_xla(framework, gpu):
        # XLA fuses elementwise ops; MaxText's GPU attention is cuDNN's fused kernel (cudnn_flash_te)
        trainer = {"fused": True, "tp_overlap": False, "attention": "flash3", "sp_any_length": True}
    if name not in TRAINERS and hopper and (year or 0) >= FIRST_FLASH3_YEAR:
        # a trainer we know nothing of, on Hopper since 2024: the large stacks publishing such runs
        # (Transformer Engine's, XLA's, in-house ones) run FlashAttention-3 class kernels
        trainer = {**trainer, "attention": "flash3"}
    attention = trainer.get("attention", "flash")
    if "attention" not in trainer and year is not None and year <= LAST_MATERIALIZED_YEAR:
        attention = "materialized"  # the kernels of the day kept the s×s scores
    if "fused" not in trainer and year is not None and year <= LAST_UNFUSED_YEAR:
        trainer = {**trainer, "fused": False}
    return trainer, kernel_on(attention, hopper)
