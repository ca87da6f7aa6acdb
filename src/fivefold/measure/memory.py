"""Per-rank memory, measured rather than estimated.

* params / grads / optimizer state: bytes of the tensors this rank holds, walking local tensors
  (a DTensor counts only its local shard; a tied weight counts once). Optimizer state counts
  every non-scalar state tensor (AdamW: exp_avg and exp_avg_sq); the 0-d step counters are left
  out so the arithmetic stays "2 × parameter bytes" for fp32 AdamW.
* activations: the peak of bytes saved for backward that are alive at once, seen through
  `torch.autograd.graph.saved_tensors_hooks` and counted per unique storage (views of one
  tensor count once; parameters, which the backward also saves, are not activations).
  Tensors saved inside a recomputed region are not saved at all, so they are not counted.
* device: `torch.cuda.max_memory_allocated` on GPU; on CPU the process's peak resident size.
"""

from __future__ import annotations

import resource
import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank stores: a DTensor's local shard, or `t` itself."""
    inner = getattr(t, "_local_tensor", None)
    local = inner if inner is not None else t
    # an async collective's result (DTensor redistribute with async_op) wraps its buffer in `elem`
    return getattr(local, "elem", local) if type(local).__name__ == "AsyncCollectiveTensor" else local


def tensor_bytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


def unique_parameters(model_parts: Iterable[nn.Module]) -> list[nn.Parameter]:
    seen: set[int] = set()
    params = []
    for part in model_parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer
    out = []
    for state in inner.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def state_bytes(model_parts: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank."""
    params = unique_parameters(model_parts)
    return {
        "params": sum(tensor_bytes(p) for p in params),
        "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(tensor_bytes(t) for t in optimizer_state_tensors(optimizer)) if optimizer else 0,
    }


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter's memory, not an activation's. Other leaves that require grad are activations: a
    pipeline stage's input, received from the previous stage, which its first block (or that block's
    checkpoint) saves."""
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or _aliases_parameter(t)


# autograd nodes of ops that hand on the same memory: views (and their transposes, selections and
# slices) and a DTensor's local tensor
ALIASING = (
    "View",
    "Alias",
    "ToTorchTensor",
    "TBackward",
    "Transpose",
    "Select",
    "Slice",
    "Permute",
    "Expand",
)


def _aliases_parameter(t: torch.Tensor) -> bool:
    """A parameter seen through aliases only (views, a DTensor's `to_local()`, as expert parallelism
    hands its experts their weights, FSDP's gathered ones included): the parameter's memory, not an
    activation's. A cast or any computation in the chain makes new memory and ends the walk."""
    fn = t.grad_fn
    for _ in range(8):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":  # reached the leaf: a parameter
            return True
        if not any(word in name for word in ALIASING) or not fn.next_functions:
            return False
        fn = fn.next_functions[0][0]
    return False


class _Saved:
    """What autograd keeps instead of the tensor: dies exactly when autograd lets go of it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Context manager: the peak bytes of activations saved for backward and alive together.

    A storage is live from the first time the forward saves a tensor on it until the last saved
    tensor on it is released by the backward (or the graph is dropped).
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._holders: dict[int, int] = {}  # storage address -> saved tensors holding it
        self._sizes: dict[int, int] = {}
        self._hooks: Any = None

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live_bytes -= self._sizes.pop(key)

    def _pack(self, t: torch.Tensor) -> Any:
        if _is_parameter(t):
            return t
        storage = local_tensor(t).untyped_storage()
        key = storage.data_ptr()
        if key == 0:  # empty or meta storage: nothing held
            return t
        if key not in self._holders:
            self._holders[key] = 0
            self._sizes[key] = storage.nbytes()
            self.live_bytes += self._sizes[key]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._holders[key] += 1
        # a detached alias (same storage and version counter): an op that saves its own output would
        # otherwise hold its node through the handle, a cycle through C++ that only a backward's
        # release breaks; a split backward's input pass retains the graph, so the nodes it alone
        # runs would never let go, and the meter would count them (and keep them) to the end
        saved = _Saved(t.detach())
        weakref.finalize(saved, self._release, key)
        return saved

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


def device_memory(device: torch.device) -> dict[str, int]:
    """Peak memory of the device (GPU) or of the process (CPU), in bytes."""
    if device.type == "cuda":
        return {
            "device_peak": torch.cuda.max_memory_allocated(device),
            "device_reserved": torch.cuda.max_memory_reserved(device),
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rss_peak": rss if sys.platform == "darwin" else rss * 1024}
