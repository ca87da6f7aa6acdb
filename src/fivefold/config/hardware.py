"""`HardwareSpec`: one accelerator and its links, as the planner sees them."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from fivefold.errors import FivefoldError

DEFAULT_GEMM_HALF_DIM = 128.0  # a GPU's tensor cores (benchmarks/bench_gemm_shapes.md)
# A FlashAttention-class kernel's fixed work per query block (loading Q, the last rescale, writing O
# and the log-sum-exp) costs about as much as scoring this many keys, so short sequences, and causal
# ones most, run below the kernel's long-sequence rate. FlashAttention-2's published A100 causal
# forward+backward rates at head dim 128 (about 134 TFLOP/s at 1k tokens, 189 at 16k) fit 230 keys.
DEFAULT_ATTENTION_FIXED_KEYS = 256.0


@dataclass
class HardwareSpec:
    """One accelerator kind and its links. Bandwidths are GB/s per GPU per direction."""

    name: str
    gpu_memory_gb: float
    peak_tflops: float  # dense 16-bit tensor-core peak, vendor-published
    gpus_per_node: int = 8
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 25.0
    hbm_gbps: float = 2000.0
    intra_node_latency_us: float = 3.0
    inter_node_latency_us: float = 10.0
    # host time of each collective beyond its wire time, where the runtime issues it from Python:
    # a tensor-parallel one through DTensor (sharding propagation, redistribution, autograd
    # wrapping), an FSDP one through its per-unit hooks (copy-in and copy-out, buffer bookkeeping), a
    # context-parallel core's (Ulysses' all-to-alls, the all-gather core's) through torch's functional
    # collectives and their autograd wrapping (the ring's send/recv pairs are bare). A GPU's host
    # runs ahead of its kernels and hides it (0); a CPU's host is the compute
    tp_dispatch_us: float = 0.0
    fsdp_dispatch_us: float = 0.0
    cp_dispatch_us: float = 0.0
    # a matmul whose smallest dimension is this runs at half the large-GEMM rate: a GPU's tiles and
    # waves fill worse as a dimension shrinks; 0: every shape at the full rate (a CPU's vector units)
    gemm_half_dim: float = DEFAULT_GEMM_HALF_DIM
    # an attention kernel's fixed work per query block, in keys' worth of scores; 0: none (a CPU's
    # attention, which is not tiled into query blocks)
    attention_fixed_keys: float = DEFAULT_ATTENTION_FIXED_KEYS
    # achievable fractions (calibrated knobs with a physical meaning; see docs/planner.md)
    matmul_efficiency: float = 0.0  # 0: the planner's default for this peak
    link_efficiency: float = 0.0
    memory_efficiency: float = 0.0  # share of hbm_gbps streaming kernels sustain; 0: planner default
    tdp_w: float = 0.0  # board power the peak is quoted at
    power_limit_w: float = 0.0  # a lower cap set by the operator: clocks drop as its cube root
    attention_efficiency: float = 0.0  # share of the peak attention kernels reach; 0: 0.8 × matmul
    fp8_speedup: float = 0.0  # fp8 matmul rate over the 16-bit one (tensor-core peak ratio 2); 0: default
    # fixed host-side time per optimizer step (optimizer and clipping launches, loss sync); 0: default
    step_overhead_s: float = 0.0
    # FlashAttention-class kernels exist for this device (Ampere and newer, ROCm CDNA2+, TPU);
    # without them attention materialises the s×s scores
    flash_attention: bool = True
    # collectives run beside the compute (their own stream and copy engines); not on a CPU, whose
    # cores do both: there every collective, its host-side copies and hooks, sits on the critical path
    comm_overlap: bool = True
    # on a CPU device (no `comm_overlap`), the cores each rank computes with: the runtime gives each of
    # a machine's local ranks its share of the cores (`host_threads`); 0: as `fivefold train` would
    # run the planned layout on this machine. The preset's rates are one core's
    threads_per_rank: float = 0.0
    # host time of one transformer block's forward on a CPU device, one micro-batch: eager PyTorch
    # dispatches each op and records it for autograd whatever its size (the backward's, twice as many
    # ops, cost twice); the threads do not share it. 0 on a GPU, whose host runs ahead of its kernels
    block_dispatch_us: float = 0.0

    def validate(self) -> HardwareSpec:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise FivefoldError(f"hardware {self.name}: {f.name} must be a finite number, got {value}")
            if isinstance(value, int | float) and not isinstance(value, bool) and value > MAX_VALUE:
                raise FivefoldError(
                    f"hardware {self.name}: {f.name} must be at most {MAX_VALUE:g}, got {value:g}"
                )
        for name in POSITIVE:
            if getattr(self, name) < MIN_VALUE:  # 5e-324 is positive, and plans a step of inf seconds
                raise FivefoldError(
                    f"hardware {self.name}: {name} must be at least {MIN_VALUE:g} (its unit: GB, TFLOP/s or "
                    f"GB/s), got {getattr(self, name):g}"
                )
        for name in NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise FivefoldError(
                    f"hardware {self.name}: {name} must be 0 or more, got {getattr(self, name)}"
                )
        for name in FRACTIONS:  # 0 stands for the planner's default
            value = getattr(self, name)
            if not (value == 0 or MIN_FRACTION <= value <= 1):
                raise FivefoldError(
                    f"hardware {self.name}: {name} is a fraction ({MIN_FRACTION:g} to 1; 0: the default), "
                    f"got {value:g}"
                )
        return self


def host_threads(local_ranks: int) -> int:
    """Intra-op threads for each of `local_ranks` ranks on this machine: OMP_NUM_THREADS when the
    user set it, else the cores this process may run on divided among the ranks (at least 1), so
    ranks do not oversubscribe the cores and a lone rank uses all of them."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


# every figure of a device (GB, TFLOP/s, GB/s, µs, W) is far below this; 1e300 overflowed the planner
MAX_VALUE = 1e9
# the least a rate, size or share may be: below, a plan's times overflow to inf and its MFU to NaN (a
# CPU's calibrated matmul share is about 0.01, its peak 0.2 TFLOP/s)
MIN_VALUE = 1e-3
MIN_FRACTION = 1e-4
POSITIVE = ("gpu_memory_gb", "peak_tflops", "gpus_per_node", "intra_node_gbps", "inter_node_gbps", "hbm_gbps")
NON_NEGATIVE = (
    "intra_node_latency_us",
    "inter_node_latency_us",
    "tp_dispatch_us",
    "gemm_half_dim",
    "attention_fixed_keys",
    "fsdp_dispatch_us",
    "cp_dispatch_us",
    "tdp_w",
    "power_limit_w",
    "fp8_speedup",
    "step_overhead_s",
    "threads_per_rank",
    "block_dispatch_us",
)
FRACTIONS = ("matmul_efficiency", "link_efficiency", "memory_efficiency", "attention_efficiency")

# a substring of a GPU's name (a published run's, or torch's name of a CUDA device) -> its preset;
# the more specific names first
GPU_NAME_PRESETS = {
    "A100-40": "a100-40gb",
    "A100 40": "a100-40gb",
    "A100-SXM4-40": "a100-40gb",
    "A100": "a100-80gb",
    "A800": "a800-80gb",
    "GH200": "h100-80gb",  # the H100 die; no preset of its own (its nodes' links vary by system)
    "H100 PCIE": "h100-pcie",  # before "H100": the PCIe and NVL cards run slower clocks
    "H100-PCIE": "h100-pcie",
    "H100 NVL": "h100-nvl",
    "H100-NVL": "h100-nvl",
    "H100": "h100-80gb",
    "H800": "h800",
    "HOPPER": "h100-80gb",
    "H200": "h200",
    "H20": "h20",  # after "GH200" and "H200", which contain it
    "GB200": "b200",
    "B200": "b200",
    "V100": "v100-32gb",
    "L40S": "l40s",
    "MI250": "mi250x",
    "MI300": "mi300x",
    "MI325": "mi325x",
    "GAUDI2": "gaudi2",
    "GAUDI 2": "gaudi2",
    "HL-225": "gaudi2",
    "GAUDI3": "gaudi3",
    "GAUDI 3": "gaudi3",
    "HL-325": "gaudi3",
    "TPU V3": "tpu-v3",
    "TPUV3": "tpu-v3",
    "TPU-V3": "tpu-v3",
    "TPU V4": "tpu-v4",
    "TPUV4": "tpu-v4",
    "TPU V5P": "tpu-v5p",
    "TPUV5P": "tpu-v5p",
    "TPU V5E": "tpu-v5e",
    "TPUV5E": "tpu-v5e",
    "TPU-V5E": "tpu-v5e",
    "V5LITE": "tpu-v5e",  # the Cloud TPU API's name for v5e ("v5litepod")
    "V5 LITE": "tpu-v5e",
    "TPU V6E": "tpu-v6e",
    "TPUV6E": "tpu-v6e",
    "TPU-V6E": "tpu-v6e",
    "TRILLIUM": "tpu-v6e",
    # a generation named without its part ("NVIDIA Ampere GPUs", as some papers state their cluster):
    # its training part, after every specific name above
    "AMPERE": "a100-80gb",
    "BLACKWELL": "b200",
    "VOLTA": "v100-32gb",
    "CPU": "cpu",
}


def preset_for_gpu_name(name: str) -> str | None:
    """The hardware preset of a GPU by its name ("NVIDIA H100 80GB HBM3", "A100 40GB", "TPU v5p"),
    or None for a GPU without one."""
    upper = name.upper()
    return next((preset for key, preset in GPU_NAME_PRESETS.items() if key in upper), None)
