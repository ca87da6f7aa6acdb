"""Every private PyTorch API fivefold relies on, in one place.

Measurement has to see what torch does not publish: the raw C++ entry point of an op, the dispatch
key just below autograd, the removal of a kernel library, a functional collective's group name,
a process group by its name, the pipeline schedules' batched point-to-point calls, and the mesh
flatten/unflatten that torch exposes only with a leading underscore. Each touch point is one small
function here, so a torch upgrade that moves one breaks in one file, and `check()` (run by the tests
on the installed torch) names what is missing instead of failing deep inside a training step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fivefold.errors import FivefoldError

TESTED_TORCH = ("2.13",)  # the minor versions whose internals these functions were written against


def raw_call(op: Any) -> Callable:
    """An OpOverload's C++ entry point: skips the Python-side checks that reject TorchBind args."""
    return op._op


def below_autograd() -> contextlib.AbstractContextManager:
    """Redispatch below the ADInplaceOrView key (what a kernel registered there must do)."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


def destroy_library(lib: torch.library.Library) -> None:
    """Remove the kernels a `torch.library.Library` registered (torch has no public remove)."""
    lib._destroy()


def group_name(group: Any, tag: str = "") -> str:
    """The name functional collectives give a group argument (a ProcessGroup, a mesh, ranks)."""
    import torch.distributed._functional_collectives as funcol

    return funcol._resolve_group_name(group, tag)


def process_group_named(name: str) -> Any | None:
    """The ProcessGroup registered under `name`, or None where torch does not know it."""
    try:
        return torch._C._distributed_c10d._resolve_process_group(name)
    except (RuntimeError, AttributeError):
        return None


@contextlib.contextmanager
def pipeline_p2p(
    post: Callable[[Callable, list, str | None], list], wait: Callable[[Callable, list], None]
) -> Iterator[None]:
    """Route the pipeline schedules' batched send/recv through `post(original, ops, desc)` and
    `wait(original, works)` while inside; the schedules call these module-level functions and offer
    no hook of their own."""
    from torch.distributed.pipelining import schedules

    original_post, original_wait = schedules._batch_p2p, schedules._wait_batch_p2p
    schedules._batch_p2p = lambda ops, desc=None: post(original_post, ops, desc)
    schedules._wait_batch_p2p = lambda works: wait(original_wait, works)
    try:
        yield
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = original_post, original_wait


def flatten_mesh(mesh: Any, name: str) -> Any:
    """Several dims of a DeviceMesh as one named dim sharing the root (e.g. fsdp×cp)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: Any, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """One dim of a DeviceMesh split into named dims sharing the root (e.g. expert_fsdp×ep)."""
    return mesh._unflatten(dim, sizes, names)


def _cpu_flash_attention_ops() -> tuple[Any, Any]:
    aten = torch.ops.aten
    return (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    )


def cpu_flash_attention_ops() -> tuple[Any, Any] | None:
    """The forward and backward of torch's CPU flash-attention kernel (what SDPA dispatches to on
    CPU), or None where this torch has no such op."""
    try:
        return _cpu_flash_attention_ops()
    except AttributeError:
        return None


def missing() -> list[str]:
    """The internals this torch lacks (empty when everything fivefold needs is there)."""
    from torch.distributed import device_mesh
    from torch.distributed.pipelining import schedules

    probes = {
        "OpOverload._op": lambda: torch.ops.aten.add.Tensor._op,
        "torch._C._AutoDispatchBelowADInplaceOrView": lambda: torch._C._AutoDispatchBelowADInplaceOrView,
        "torch.library.Library._destroy": lambda: torch.library.Library._destroy,
        "_functional_collectives._resolve_group_name": lambda: (
            __import__(
                "torch.distributed._functional_collectives", fromlist=["_resolve_group_name"]
            )._resolve_group_name
        ),
        "torch._C._distributed_c10d._resolve_process_group": lambda: (
            torch._C._distributed_c10d._resolve_process_group
        ),
        "pipelining.schedules._batch_p2p": lambda: schedules._batch_p2p,
        "pipelining.schedules._wait_batch_p2p": lambda: schedules._wait_batch_p2p,
        "DeviceMesh._flatten": lambda: device_mesh.DeviceMesh._flatten,
        "DeviceMesh._unflatten": lambda: device_mesh.DeviceMesh._unflatten,
        "aten._scaled_dot_product_flash_attention_for_cpu(_backward)": _cpu_flash_attention_ops,
    }
    lacking = []
    for name, probe in probes.items():
        try:
            probe()
        except AttributeError:
            lacking.append(name)
    return lacking


def check() -> None:
    """Raise one clear error when the installed torch lacks an internal fivefold needs."""
    lacking = missing()
    if lacking:
        raise FivefoldError(
            f"torch {torch.__version__} lacks {', '.join(lacking)}, which fivefold's runtime and "
            f"measurement use; install a torch of a tested series ({', '.join(TESTED_TORCH)})"
        )
