"""Where a run's compute precision is decided: one rule for train, verify and the pipeline.

* fp32: nothing is cast.
* bf16 with FSDP (`--fsdp` > 1) or torch's FSDP2-based `replicate` (tensor-parallel weights with
  replicas): FSDP2's `MixedPrecisionPolicy` gathers the fp32 master weights as bf16 once per
  unit and reduces gradients in fp32. No autocast on top: the weights already are bf16, and a
  second cast layer would only add work.
* bf16 otherwise: `torch.autocast`, entered once around each forward by the runner that calls
  the model (never nested), over fp32 master weights; AdamW steps those fp32 weights.

The loss (`lm_loss`) and the RMSNorm statistics are computed in fp32 in either case.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fivefold.config import Layout
from fivefold.layout_math import replica_wrapper

Mode = Literal["fp32", "fsdp", "autocast"]


def uses_fsdp(layout: Layout) -> bool:
    return replica_wrapper(layout) == "fsdp"


def uses_replicate(layout: Layout) -> bool:
    """Replicas of tensor-parallel weights: torch's FSDP2-based `replicate` rather than DDP."""
    return replica_wrapper(layout) == "replicate"


def precision_mode(dtype: str, layout: Layout) -> Mode:
    """How `dtype` is applied to a run of `layout` (see the module docstring)."""
    if dtype != "bf16":
        return "fp32"
    return "fsdp" if uses_fsdp(layout) or uses_replicate(layout) else "autocast"


def mp_policy(dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy: bf16 compute from fp32 masters, fp32 gradient reduction."""
    if dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def forward_context(dtype: str, layout: Layout, device_type: str) -> contextlib.AbstractContextManager:
    """The context a runner enters around each forward: autocast where the mode says so, else nothing.

    A fresh object per call, so it can be entered wherever the runner needs it.
    """
    if precision_mode(dtype, layout) == "autocast":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
