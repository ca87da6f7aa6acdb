"""The `Plan` a prediction returns, and the usable memory it is compared with."""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.plan.comm import Collective
from fivefold.plan.memory import Memory
from fivefold.plan.runshape import dtype_name
from fivefold.plan.spec import Arch, TrainShape

MEMORY_RESERVE = 0.04  # share of HBM kept by the CUDA context, NCCL buffers and fragmentation
# Half-width of the band around a predicted MFU, from the planner's leave-one-source-out errors over the
# bundled published runs: 84% of them fall inside it (docs/planner.md); never below their mean |error|
# (tests/test_plan_validation.py keeps it honest).
MFU_BAND = 0.15


def size_words(x: float) -> str:
    """Bytes in GB, or in MB/KB where GB would print 0.0 (a small model's weights)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if x >= 0.05 * scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x / 1e3:.1f} KB"


def fit_words(margin_bytes: float) -> str:
    """'fits with 6 GB to spare' / 'does not fit by 3 GB' (GB = 1e9 bytes, usable memory)."""
    gb = abs(margin_bytes) / 1e9
    amount = f"{gb:.0f} GB" if gb >= 1 else f"{gb:.1f} GB"
    return f"fits with {amount} to spare" if margin_bytes >= 0 else f"does not fit by {amount}"


@dataclass
class Plan:
    model: ModelSpec
    hardware: HardwareSpec
    layout: Layout
    shape: TrainShape
    arch: Arch
    gpus_per_node: int
    microbatches: int
    memory: Memory
    fits: bool
    comm: list[Collective]
    compute_time_s: float
    bubble_time_s: float
    bubble_fraction: float
    exposed_comm_s: float
    optimizer_time_s: float
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    hardware_tflops_per_gpu: float
    hfu: float
    model_flops_per_token: float
    hardware_flops_per_token: float
    mfu_causal: float
    params: int
    stage_times: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.layout.world

    @property
    def margin_bytes(self) -> float:
        """Usable memory left (negative: missing) on the worst rank."""
        return capacity(self.hardware) - self.memory.total

    @property
    def mfu_band(self) -> tuple[float, float]:
        # no run computes faster than the peak: the band stops at an MFU of 1
        return self.mfu * (1 - MFU_BAND), min(1.0, self.mfu * (1 + MFU_BAND))

    def to_json(self) -> dict[str, object]:
        lay = self.layout
        return {
            "model": self.model.name,
            "hardware": self.hardware.name,
            "gpus": self.gpus,
            "gpus_per_node": self.gpus_per_node,
            "block": self.arch.name,
            "params": self.params,
            "layout": {
                "dp": lay.dp,
                "fsdp": lay.fsdp,
                "tp": lay.tp,
                "pp": lay.pp,
                "cp": lay.cp,
                "ep": lay.ep,
                "zero": lay.zero,
                "sp": lay.sp,
                "pp_schedule": lay.pp_schedule,
                "virtual_stages": lay.virtual_stages,
                "recompute": lay.recompute,
                "recompute_layers": lay.recompute_layers,
                "order": lay.order,
                "cp_impl": lay.cp_impl,
            },
            "seq_len": self.shape.seq_len,
            "global_batch": self.shape.global_batch,
            "micro_batch": self.shape.micro_batch,
            "microbatches": self.microbatches,
            # what the figures assume of the compute (the defaults differ by device and trainer)
            "dtype": dtype_name(self.shape.act_bytes),
            "fp8": self.shape.fp8,  # fp8 linears beside 16-bit activations
            "kernels": "fused" if self.shape.fused else "eager",
            "memory": self.memory.to_json(),
            "memory_capacity": int(capacity(self.hardware)),
            "fits": self.fits,
            "fits_margin_bytes": int(self.margin_bytes),
            "comm": [c.to_json() for c in self.comm],
            "compute_time_s": self.compute_time_s,
            "bubble_time_s": self.bubble_time_s,
            "bubble_fraction": self.bubble_fraction,
            "exposed_comm_s": self.exposed_comm_s,
            "optimizer_time_s": self.optimizer_time_s,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "mfu_low": self.mfu_band[0],
            "mfu_high": self.mfu_band[1],
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "hfu": self.hfu,
            "model_flops_per_token": self.model_flops_per_token,
            "hardware_flops_per_token": self.hardware_flops_per_token,
            "flops_convention": "model FLOPs = 6·N_matmul + 12·layers·s·d_attn per token, full (non-causal) "
            "attention square as Megatron/PaLM; mfu_causal counts only the causal half",
            "mfu_causal": self.mfu_causal,
            "stage_times": self.stage_times,
            "notes": self.notes,
        }


def capacity(hw: HardwareSpec) -> float:
    """Bytes the planner may fill. HBM sizes are binary: an "80 GB" H100 or A100 is five 16 GiB
    stacks (CUDA reports 79.2 GiB), a "141 GB" H200 141 GiB usable of six 24 GiB stacks."""
    return hw.gpu_memory_gb * 2**30 * (1 - MEMORY_RESERVE)
