"""Run a function on N local gloo ranks with torch's elastic launcher and collect what each returns.

Used by commands that compare a layout with the single-process model (`fivefold verify`) and by
the layout benchmark. A rank that raises surfaces as one FivefoldError (bad input) or one line
naming the rank and the exception; the launcher's own log chatter is silenced.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import signal
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from fivefold.config.hardware import host_threads
from fivefold.errors import FivefoldError
from fivefold.outputs import write_without_a_reader

_QUIET = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
    "torch.multiprocessing",
)


LOOPBACK = "127.0.0.1"
# local ranks one command starts: more than any node has GPUs; far more gloo ranks than cores only thrash
MAX_LOCAL_RANKS = 64


def local_launch_config(nproc: int, port: int, own_signals: bool = False, log_dir: str | None = None) -> Any:
    """torch's elastic launcher for `nproc` ranks on this machine, as `torchrun --standalone` sets it up:
    c10d rendezvous on the loopback store at `port`, no restarts, fresh (spawned) interpreters.
    `own_signals`: the caller handles SIGINT/SIGTERM itself (torch's launcher would turn them into
    an exception with a traceback)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    extra: dict[str, Any] = {"signals_to_handle": "SIGHUP,SIGQUIT"} if own_signals else {}
    if log_dir is not None:
        extra["logs_specs"] = DefaultLogsSpecs(log_dir=log_dir)
    return LaunchConfig(
        **extra,
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"fivefold-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{LOOPBACK}:{port}",
        rdzv_configs={"timeout": 120, "is_host": True},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=LOOPBACK,
    )


@contextlib.contextmanager
def loopback_store() -> Iterator[Any]:
    """A TCPStore server that listens on 127.0.0.1 only, for a run that stays on this machine.

    torch's TCPStore listens on every interface whatever host it is given, so anyone who can reach
    the machine could write into a local run's rendezvous. Here the listening socket is bound to the
    loopback address first and handed to the store; the launcher's rendezvous and the workers' store
    then share this one server (same port, `multi_tenant`) instead of opening their own."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        LOOPBACK,
        port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.fileno(),
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    own_server = handler._create_tcp_store_server

    def shared_server(self: Any, master_addr: str, master_port: int) -> Any:
        # the workers' store: torch would open a second server on every interface
        return dist.TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, wait_for_workers=False)

    handler._create_tcp_store_server = shared_server
    try:
        yield store
    finally:
        handler._create_tcp_store_server = own_server
        del store
        sock.close()


@contextlib.contextmanager
def local_launcher(nproc: int, own_signals: bool = False) -> Iterator[Any]:
    """The launch config for `nproc` local ranks, with a loopback-only store and a quiet launcher."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # gloo's own sockets on loopback too
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    # a rank stopped mid-collective (Ctrl-C) has torch's C++ side warn of unwaited work at exit, beside
    # the one line the launcher prints; its errors still show
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    log_dir = tempfile.mkdtemp(prefix="fivefold-launch-")  # torch's own per-run files, removed after
    try:
        with quiet_launcher(), loopback_store() as store:
            yield local_launch_config(nproc, store.port, own_signals, log_dir)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


@contextlib.contextmanager
def quiet_launcher() -> Iterator[None]:
    """Silence the launcher's own log chatter; failures are reported once, by the caller. torch's
    elastic modules set their own loggers' levels, so each one under the names is quieted, not only
    the parents."""
    import torch.distributed.elastic.agent.server.api  # noqa: F401 - its logger exists from here on

    known = list(logging.root.manager.loggerDict)
    names = [n for n in known if any(n == q or n.startswith(q + ".") for q in _QUIET)] + list(_QUIET)
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _entry(fn: Callable[..., Any], args: tuple, backend: str = "gloo") -> Any:
    import warnings

    import torch
    import torch.distributed as dist

    write_without_a_reader()
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    # each local rank's share of the cores (the planner counts the same: `host_threads`)
    torch.set_num_threads(host_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
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


class RanksStopped(FivefoldError):
    """A signal stopped the ranks (they were terminated): one line, exit code 128 + the signal."""

    label = "stopped"

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}; the ranks were stopped")
        self.exit_code = 128 + signum


class RankFailed(FivefoldError):
    """A rank died or raised: one line naming it and its last words, exit code 1 (a fault, not bad
    input)."""

    exit_code = 1

    def __init__(self, rank: int, failure: Any) -> None:
        code = failure.exitcode
        if code is not None and code < 0:  # killed by a signal: what the others lost
            why = f"killed by {signal.Signals(-code).name}; the other ranks stopped because they lost it"
        else:
            words = last_words(failure)
            why = f"failed: {words}" if words else f"exited with code {code}"
        super().__init__(f"rank {rank} {why}")


def last_words(failure: Any) -> str:
    """The first line of what a failed rank reported (torch's error file holds it as text, or as a
    dict with its text under "message")."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line for line in str(message or "").splitlines() if line.strip()]
    return lines[0].strip()[:300] if lines else ""


# what a rank says when another rank went away first (how gloo and the store word it): not the cause
LOST_PEER = (
    "Connection closed by peer",
    "Connection reset by peer",
    "connection closed",
    "Broken pipe",
    "Connection refused",
)


def echoes_lost_peer(message: str) -> bool:
    """`message` is a rank's report that another rank went away first (an echo, not the cause)."""
    return any(words in message for words in LOST_PEER)


def the_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """Of the ranks that failed, the one that went first: a killed rank, else one that did not just
    lose a peer, the earliest reported."""
    ranked = sorted(
        failures.items(),
        key=lambda item: (
            (item[1].exitcode or 0) >= 0,
            echoes_lost_peer(last_words(item[1])),
            item[1].timestamp,
            item[0],
        ),
    )
    return ranked[0]


def spawn_ranks(fn: Callable[..., Any], nproc: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """`fn(rank, world, *args)` on `nproc` ranks (fn at module level: it is pickled); results by rank.

    `backend`: gloo (CPU), or nccl with one GPU per rank."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        with local_launcher(nproc) as config:
            returned = elastic_launch(config, _entry)(fn, args, backend)
    except SignalException as exc:  # Ctrl-C or SIGTERM: torch's launcher has stopped the ranks
        raise RanksStopped(int(exc.sigval)) from None
    except ChildFailedError as exc:
        raise RankFailed(*the_cause(exc.failures)) from None
    results = [returned[r] for r in range(nproc)]
    for status, value in results:
        if status == "bad-input":
            raise FivefoldError(value)
    return [value for _, value in results]
