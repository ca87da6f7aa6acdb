"""Run a function on N gloo ranks in separate processes and return what each rank returned.

    from distributed import run_distributed

    def _body(rank: int, world: int, scale: float) -> float:   # module level: it is pickled
        t = torch.ones(1) * rank * scale
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(_body, 4, 2.0) == [12.0] * 4

* The rendezvous is a TCPStore the parent opens on port 0, so the OS picks a free port and no two
  runs race for one; every child connects to it and joins the default process group.
* A rank that raises makes `run_distributed` raise `RankFailed` with that rank's traceback; the
  other ranks are killed at once instead of hanging in a collective.
* `timeout` bounds the whole run; on expiry every child is killed and `TimeoutError` names the
  ranks that had not finished.
* Ranks are forked from a fork server that has imported torch once (`forkserver` start method),
  so a run starts in well under a second instead of paying a torch import per rank; the function
  and its arguments are pickled, so `fn` must live at module level.
* Each child destroys its process group on the way out, and uses one intra-op thread so several
  ranks share a small machine politely.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""

    def __init__(self, rank: int, trace: str) -> None:
        super().__init__(f"rank {rank} failed:\n{trace}")
        self.rank = rank
        self.trace = trace


def _child(
    rank: int,
    world: int,
    port: int,
    backend: str,
    fn: Callable,
    args: tuple,
    kwargs: dict,
    results: Any,
    pg_timeout_s: float,
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env = {
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
    }
    os.environ.update(env)
    try:
        store = dist.TCPStore(
            HOST, port, world_size=None, is_master=False, timeout=timedelta(seconds=pg_timeout_s)
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s)
        )
        value = fn(rank, world, *args, **kwargs)
        payload = pickle.dumps(value)  # plain pickle: tensors travel by value, not shared memory
        results.put((rank, True, payload))
        dist.barrier()  # let every rank finish its collectives before anyone tears down
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(rank, world, *args, **kwargs)` on `world` spawned ranks; return results by rank."""
    ctx = mp.get_context("forkserver")
    # the fork server imports torch once; every rank then starts as a cheap fork of it
    ctx.set_forkserver_preload(["torch", "torch.distributed", "fivefold.config", "fivefold.mesh"])
    results = ctx.Queue()
    store = dist.TCPStore(
        HOST, 0, world_size=None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world, store.port, backend, fn, args, kwargs, results, timeout),
            daemon=True,
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise RankFailed(
                        dead[0], f"process exited with code {procs[dead[0]].exitcode} before reporting"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(got))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
                continue
            if not ok:
                raise RankFailed(rank, payload)
            got[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(5.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        del store
    return [got[r] for r in range(world)]
