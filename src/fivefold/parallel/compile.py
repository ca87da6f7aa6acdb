"""`--compile`: `torch.compile` on each transformer block.

Applied after tensor parallelism and recompute and before FSDP (the order torch's FSDP2 expects:
the compiled block is then the FSDP unit whose parameters are gathered around it). Each block is
compiled in place (`nn.Module.compile`), so parameter names, checkpoints and hooks stay those of
the eager model. The embedding and the head stay eager. The training loss is compiled too (as
TorchTitan does): the fp32 copy of the logits, the log-softmax and the pick of each label become one
pass over the vocabulary-wide tensor instead of three. Under tensor parallelism the loss runs on
vocabulary shards (`loss_parallel`, DTensor work) and stays eager.

Refused where the compiled block would meet work that torch.compile does not trace on this
runtime: expert parallelism (all-to-all dispatch with data-dependent row counts) and context
parallelism (the ring's point-to-point exchange inside attention).

The backend is torch's default (inductor) unless FIVEFOLD_COMPILE_BACKEND names another, e.g.
`aot_eager`: the same graph capture and autograd tracing without generating C++ kernels, which
the tests use to stay fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from fivefold.config import Layout, TrainSpec
from fivefold.errors import FivefoldError
from fivefold.model.transformer import lm_loss

# axis -> why a compiled block cannot run with it
_REFUSED = {
    "ep": "expert dispatch exchanges data-dependent row counts (all-to-all), "
    "which torch.compile does not trace",
    "cp": "the context-parallel ring exchanges key/value shards point to point inside attention, "
    "which torch.compile does not trace",
}


def check_compile(layout: Layout) -> None:
    """Refuse --compile with an axis it does not run with (one line, naming what is valid)."""
    for axis, why in _REFUSED.items():
        if getattr(layout, axis) > 1:
            raise FivefoldError(
                f"--compile does not run with --{axis} {getattr(layout, axis)}: {why}; "
                "drop --compile or use dp, fsdp, tp (+sp) and pp"
            )


def _backend() -> str:
    return os.environ.get("FIVEFOLD_COMPILE_BACKEND", "inductor")


def training_loss(train: TrainSpec, layout: Layout) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`lm_loss`, compiled with --compile where the logits are plain tensors (no tp)."""
    if not train.compile or layout.tp > 1:
        return lm_loss
    return torch.compile(lm_loss, backend=_backend())


def compile_blocks(model: nn.Module) -> None:
    """Compile each transformer block of `model` (a full model or a pipeline chunk) in place."""
    backend = _backend()
    layers = model.model.layers
    for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        block.compile(backend=backend)
