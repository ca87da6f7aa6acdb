"""Activation recomputation, applied to a model from outside.

  * `none`      keep every activation the backward needs;
  * `selective` recompute only the attention core (scores, softmax, weighted sum) of each block,
                as Megatron's selective recompute does: it is the part whose saved tensors grow
                with s² while costing few FLOPs to redo;
  * `full`      keep only each block's input and recompute the whole block in backward;
                with `--recompute-layers N` only the first N blocks of each chunk (Megatron's
                block method, TorchTitan's layer-level AC on a subset): the blocks left alone keep
                their activations, which spends the memory that is left on less recompute.

Each chosen module's forward is routed through `torch.utils.checkpoint.checkpoint` (the
non-reentrant implementation torch's checkpoint wrapper uses) by swapping the module's class for
a subclass, the way FSDP2's `fully_shard` does, rather than by wrapping it in another module:
parameter names, state-dict keys and the name-seeded initialisation stay exactly those of the
plain model, `isinstance` still holds, and hooks that FSDP or tensor parallelism register on the
module keep firing around the call.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from fivefold.config import RECOMPUTE, recomputed_blocks
from fivefold.errors import FivefoldError

_MARK = "_fivefold_recompute"


_recomputed_classes: dict[type, type] = {}


def _recomputed_class(cls: type) -> type:
    """A subclass of `cls` whose forward runs under checkpoint (one per class, reused)."""
    if cls not in _recomputed_classes:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

        _recomputed_classes[cls] = type(
            f"Recomputed{cls.__name__}", (cls,), {"forward": forward, _MARK: True}
        )
    return _recomputed_classes[cls]


def _checkpoint_forward(module: nn.Module) -> None:
    if getattr(module, _MARK, False):
        return  # already applied: recomputing twice would only cost time
    module.__class__ = _recomputed_class(module.__class__)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of `model` (or of a pipeline chunk), in order."""
    decoder = getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise FivefoldError("recompute needs a model with `model.layers` (a fivefold Transformer)")
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def apply_recompute(model: nn.Module, mode: str, layers: int = 0) -> nn.Module:
    """Apply `mode` (none | selective | full) to the blocks of `model` (or of a pipeline chunk):
    every block, or under full recompute the first `layers` of them (0: all)."""
    if mode not in RECOMPUTE:
        raise FivefoldError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {mode!r}")
    if mode == "none":
        return model
    chosen = blocks(model)
    if mode == "full":
        chosen = chosen[: recomputed_blocks(mode, layers, len(chosen))]
    for block in chosen:
        _checkpoint_forward(block.self_attn.core if mode == "selective" else block)
    return model


def is_recomputed(block: nn.Module) -> bool:
    """Whether `block` runs its whole forward again in the backward (full recompute)."""
    return bool(getattr(block, _MARK, False))


def recompute_mode(model: nn.Module) -> str:
    """Which mode a model carries (for reports and tests)."""
    found = blocks(model)
    if found and getattr(found[0], _MARK, False):
        return "full"
    if found and getattr(found[0].self_attn.core, _MARK, False):
        return "selective"
    return "none"
