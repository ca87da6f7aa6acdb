"""Collective-only interception: a Python kernel on the ADInplaceOrView key of each collective op.

A `TorchDispatchMode` sees every op, so it pays a Python round trip on every matmul and view as
well (tens of microseconds each on a CPU step of a small model: well above the ledger's 2 %
budget). These kernels sit on the c10d and functional-collective ops only: they report the op
to every active observer and redispatch below autograd to the real kernel, so other ops cost
nothing. They also see collectives issued from other threads (a backward thread's DDP
all-reduce), which a thread-local mode would not.

The key is ADInplaceOrView, just below autograd: the functional collectives carry their own
autograd kernels (registered by torch in Python), which a kernel on the Autograd key would
replace. Tensors made under `torch.inference_mode()` skip that key, so their collectives are not
seen (use `method="dispatch"` there).

Collectives issued inside a tensor subclass's dispatch (DTensor's loss-parallel softmax and
cross-entropy reductions, redistributions during sharding propagation) run below autograd, where
ADInplaceOrView is excluded, so no kernel sees them (nor does a dispatch mode: DTensor runs its
handlers with Python dispatch disabled). For those, the Python entry points of the functional
collectives that DTensor calls (`all_reduce`, `all_gather_tensor`, `reduce_scatter_tensor`,
`all_to_all_single`) are wrapped too: a call the kernel did not see is reported from the wrapper,
so every collective is reported exactly once.

The kernels are registered when a first user acquires them and removed when the last user
releases them (about 2 ms each way); a ledger is a user from its first `with` until it is closed
or collected, so entering it every step costs nothing extra. Between `with` blocks a kernel with
no observer only redispatches; with no ledger alive nothing is left in the path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from fivefold import torch_internals

Observer = Callable[[Any, tuple, dict], None]  # (op overload, args, kwargs)

_observers: list[Observer] = []
_lock = threading.Lock()
_libraries: list[torch.library.Library] = []
_users = 0
_seen = threading.local()  # did a kernel report the op the current wrapped call issued?
_wrapped: dict[str, Callable] = {}  # functional-collective entry point -> the original


def _kernel_for(op: Any) -> Callable:
    call = torch_internals.raw_call(op)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        _seen.flag = True
        for observe in tuple(_observers):
            observe(op, args, kwargs)
        with torch_internals.below_autograd():
            return call(*args, **kwargs)

    return kernel


def _install(ops: dict[str, tuple[str, ...]]) -> None:
    """Register the kernels for {namespace: op names} (idempotent; the caller holds the lock)."""
    if _libraries:
        return
    import torch.distributed._functional_collectives  # noqa: F401  (registers the functional ops)

    for namespace, names in ops.items():
        lib = torch.library.Library(namespace, "IMPL")
        for name in names:
            packet = getattr(getattr(torch.ops, namespace), name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                qualified = name if overload == "default" else f"{name}.{overload}"
                lib.impl(qualified, _kernel_for(op), "ADInplaceOrView")
        _libraries.append(lib)
    _wrap_entry_points()


def _uninstall() -> None:
    for lib in _libraries:
        torch_internals.destroy_library(lib)
    _libraries.clear()
    _unwrap_entry_points()


# entry point -> (functional op it issues, its argument names in the op's schema, by position)
_ENTRY_POINTS = {
    "all_reduce": ("all_reduce", ("input", "reduce_op", "group")),
    "all_gather_tensor": ("all_gather_into_tensor", ("input", None, "group")),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", ("input", "reduce_op", None, "group")),
    "all_to_all_single": ("all_to_all_single", ("input", "output_split_sizes", "input_split_sizes", "group")),
}


def _wrap_entry_points() -> None:
    import torch.distributed._functional_collectives as funcol

    for name, (op_name, arg_names) in _ENTRY_POINTS.items():
        original = getattr(funcol, name)
        op = getattr(torch.ops._c10d_functional, op_name).default
        _wrapped[name] = original
        setattr(funcol, name, _entry_wrapper(original, op, arg_names))


def _unwrap_entry_points() -> None:
    import torch.distributed._functional_collectives as funcol

    for name, original in _wrapped.items():
        setattr(funcol, name, original)
    _wrapped.clear()


def _entry_wrapper(original: Callable, op: Any, arg_names: tuple[str | None, ...]) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _observers:
            return original(*args, **kwargs)
        outer, _seen.flag = getattr(_seen, "flag", False), False
        try:
            out = original(*args, **kwargs)
        finally:
            seen, _seen.flag = _seen.flag, outer
        if not seen:  # issued below autograd: report it as the kernel would have
            bound = {n: a for n, a in zip(arg_names, args) if n} | kwargs
            group = bound.pop("group")
            bound["group_name"] = torch_internals.group_name(group, bound.pop("tag", ""))
            bound["input"] = bound.pop("input", bound.pop("self", None))
            for observe in tuple(_observers):
                observe(op, (), bound)
        return out

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def acquire(ops: dict[str, tuple[str, ...]]) -> None:
    """Become a user of the kernels for {namespace: op names}, registering them if needed."""
    global _users
    with _lock:
        _install(ops)
        _users += 1


def release() -> None:
    """Stop being a user; the last one out removes the kernels."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0 and not _observers:
            _uninstall()


def add_observer(observer: Observer, ops: dict[str, tuple[str, ...]]) -> None:
    """Report the collective ops to `observer` (re-registering the kernels if they were removed)."""
    with _lock:
        _install(ops)
        _observers.append(observer)


def remove_observer(observer: Observer) -> None:
    with _lock:
        if observer in _observers:
            _observers.remove(observer)


def uninstall() -> None:
    """Remove the kernels now, e.g. for a baseline measurement (they return on the next use)."""
    with _lock:
        if not _observers:
            _uninstall()


def installed() -> bool:
    return bool(_libraries)
