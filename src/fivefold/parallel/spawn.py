"""Run a function on N local gloo ranks with torch's elastic launcher and collect what each returns.

Used by commands that compare a layout with the single-process model (`fivefold verify`) and by
the layout benchmark. A rank that raises surfaces as one FivefoldError (bad input) or one line
naming the rank and the exception; the launcher's own log chatter is silenced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from fivefold.errors import FivefoldError

_QUIET = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
    "torch.multiprocessing",
)


def threads_per_rank(local_ranks: int) -> int:
    """Intra-op threads for each of `local_ranks` ranks on this machine: OMP_NUM_THREADS when the
    user set it, else the cores this process may run on divided among the ranks (at least 1), so
    ranks do not oversubscribe the cores and a lone rank uses all of them."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


def local_launch_config(nproc: int) -> Any:
    """torch's elastic launcher for `nproc` ranks on this machine, as `torchrun --standalone` sets it up:
    c10d rendezvous on an OS-chosen port, no restarts, fresh (spawned) interpreters."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"fivefold-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": 120},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )


@contextlib.contextmanager
def quiet_launcher() -> Iterator[None]:
    """Silence the launcher's own log chatter; failures are reported once, by the caller."""
    levels = {name: logging.getLogger(name).level for name in _QUIET}
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _entry(fn: Callable[..., Any], args: tuple) -> Any:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            value = fn(rank, world, *args)
        except FivefoldError as exc:
            return ("bad-input", str(exc))
        dist.barrier()
        return ("ok", value)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], nproc: int, *args: Any) -> list[Any]:
    """`fn(rank, world, *args)` on `nproc` ranks (fn at module level: it is pickled); results by rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        with quiet_launcher():
            returned = elastic_launch(local_launch_config(nproc), _entry)(fn, args)
    except ChildFailedError as exc:
        rank, failure = next(iter(sorted(exc.failures.items())))
        message = str(failure.message or f"exit code {failure.exitcode}").strip().splitlines()
        raise RuntimeError(f"rank {rank} failed: {message[-1] if message else failure.exitcode}") from None
    results = [returned[r] for r in range(nproc)]
    for status, value in results:
        if status == "bad-input":
            raise FivefoldError(value)
    return [value for _, value in results]
