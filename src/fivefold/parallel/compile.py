"""`--compile`: `torch.compile` on each transformer block.

Applied after tensor parallelism and recompute and before FSDP (the order torch's FSDP2 expects:
the compiled block is then the FSDP unit whose parameters are gathered around it). Each block is
compiled in place (`nn.Module.compile`), so parameter names, checkpoints and hooks stay those of
the eager model. The embedding, the head and the loss stay eager.

Refused where the compiled block would meet work that torch.compile does not trace on this
runtime: expert parallelism (all-to-all dispatch with data-dependent row counts) and context
parallelism (the ring's point-to-point exchange inside attention).

The backend is torch's default (inductor) unless FIVEFOLD_COMPILE_BACKEND names another, e.g.
`aot_eager`: the same graph capture and autograd tracing without generating C++ kernels, which
the tests use to stay fast.
"""

from __future__ import annotations

import os

from torch import nn

from fivefold.config import Layout
from fivefold.errors import FivefoldError

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


def compile_blocks(model: nn.Module) -> None:
    """Compile each transformer block of `model` (a full model or a pipeline chunk) in place."""
    backend = os.environ.get("FIVEFOLD_COMPILE_BACKEND", "inductor")
    layers = model.model.layers
    for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        block.compile(backend=backend)
