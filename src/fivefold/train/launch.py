"""`fivefold train --nproc N`: N local ranks through torch's own elastic launcher.

Rendezvous is c10d on a store that listens on 127.0.0.1 only, at an OS-chosen port. Each rank
gets the resolved `TrainJob` as data (pickled by the spawn) and trains it in-process; gloo on CPU,
NCCL on GPU (chosen by the loop from the device). Nothing is parsed again in the ranks.

Failures surface once: a rank that fails writes its one-line reason to a shared folder and exits
non-zero; the launcher stops the other ranks, and the parent reports the first failure — a
`FivefoldError` (exit code 2) for bad input, a rank killed by a signal (whose peers then fail on
the lost connection: their errors are echoes, not the cause), otherwise the exception with the
path of its traceback (exit code 1). The shared folder is removed on every way out; a traceback is
kept in a file of its own. The launcher's own log chatter is silenced.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch

from fivefold.config import RunConfig
from fivefold.config.hardware import host_threads
from fivefold.errors import FivefoldError, storage_fault
from fivefold.outputs import write_without_a_reader
from fivefold.parallel.spawn import echoes_lost_peer, local_launcher
from fivefold.train.checkpoint import remove_unfinished
from fivefold.train.loop import run_dir_holder, train
from fivefold.train.supervise import (
    Watchdog,
    forward_signals,
    launcher_gone,
    lost_peer,
    signal_name,
    stopped_by_signal,
)

# a rank that failed only because a peer died exits this much later than it would: torch's launcher
# (polling every 0.1 s) then sees the dead peer first and reports it, not the echo
ECHO_DELAY_SECONDS = 1.0
# how long a rank that a signal stopped looks for its launcher's death before leaving the shared
# folder to it (torch's spawn sends that SIGINT while the killed launcher is still exiting)
LAUNCHER_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs to train: the validated config and where the run lives."""

    config: RunConfig
    run_dir: Path
    resume: str | None = None  # None: a new run; "latest" or a step number: continue
    progress: bool = True
    watchdog: float = 180.0  # seconds without progress on any rank before the run is stopped; 0: off
    checkpoint_on_interrupt: bool = False  # SIGINT/SIGTERM: save a checkpoint at the step boundary


def run_job(job: TrainJob, control_folder: str | None = None) -> int:
    """Train `job` in this process: alone, or as one rank of a launched world."""
    result = train(
        job.config,
        job.run_dir,
        resume=job.resume,
        progress=job.progress,
        control_folder=control_folder,
        checkpoint_on_interrupt=job.checkpoint_on_interrupt,
        heartbeat=job.watchdog > 0,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        held = f"; held-out loss {result.held_out_loss:.4f}" if result.held_out_loss is not None else ""
        print(f"run directory: {result.run_dir}{held}")
    return 0


def _rank_entry(job: TrainJob, error_dir: str) -> int:
    """Runs in each spawned rank."""
    rank = os.environ.get("RANK", "?")
    write_without_a_reader()
    launcher = os.getppid()
    (Path(error_dir) / f"rank{rank}.pid").write_text(str(os.getpid()))  # for forwarded signals
    interrupted = False
    try:
        return run_job(job, error_dir)
    except FivefoldError as exc:
        _report(error_dir, rank, exc.exit_code, str(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:  # SIGINT before the loop took over the signal
        interrupted = True
        _report(error_dir, rank, 130, "interrupted by SIGINT before the first step")
        sys.exit(130)
    except BaseException as exc:  # noqa: BLE001 - anything else is reported with its traceback
        full = storage_fault(exc, job.run_dir)
        if full is not None:  # a fault of the machine, not of the code: no traceback to read
            _report(error_dir, rank, 1, full)
            sys.exit(1)
        trace = Path(error_dir) / f"rank{rank}.traceback"
        with contextlib.suppress(OSError):
            trace.write_text(traceback.format_exc())
        _report(error_dir, rank, 1, f"{type(exc).__name__}: {exc}".splitlines()[0] + f" (traceback: {trace})")
        if lost_peer(exc):  # an echo: let torch's launcher see the rank that died first
            time.sleep(ECHO_DELAY_SECONDS)
        sys.exit(1)
    finally:
        # leaving anyway: a repeated stop signal (the killed launcher's) must not cut the cleanup short
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(sig, signal.SIG_IGN)
        grace = LAUNCHER_GRACE_SECONDS if interrupted or stopped_by_signal() else 0.0
        if launcher_gone(launcher, grace):  # the launcher died (the store with it): nobody else cleans up
            shutil.rmtree(error_dir, ignore_errors=True)


def _report(error_dir: str, rank: str, code: int, message: str) -> None:
    path = Path(error_dir) / f"rank{rank}.error"
    tmp = path.with_suffix(".tmp")
    with contextlib.suppress(OSError):  # the folder is gone with the launcher: nobody to tell
        tmp.write_text(f"{code}\n{message}")
        os.replace(tmp, path)  # whole or absent: the parent never reads half a message


def _first_failure(error_dir: Path) -> tuple[int, int, str] | None:
    """(rank, code, message) of the cause: the earliest reported failure that is not an echo (a rank
    that lost its peer). A failing rank can close its connections while it unwinds, before it reports,
    so an echo may be written first."""
    reports = []
    for path in error_dir.glob("rank*.error"):
        code, _, message = path.read_text().partition("\n")
        rank = path.stem.removeprefix("rank")
        echo = echoes_lost_peer(message)
        reports.append(
            (
                (echo, path.stat().st_mtime_ns, path.name),
                int(rank) if rank.isdigit() else -1,
                int(code),
                message,
            )
        )
    if not reports:
        return None
    _, rank, code, message = min(reports)
    return rank, code, message


def _keep_traceback(error_dir: Path, rank: int, message: str) -> str:
    """`message` pointing at a copy of the rank's traceback outside the shared folder, which is
    removed however the run ends; the echoes of other ranks go with it."""
    trace = error_dir / f"rank{rank}.traceback"
    if not trace.exists():
        return message
    handle, name = tempfile.mkstemp(prefix=f"fivefold-rank{rank}-", suffix=".traceback")
    with os.fdopen(handle, "w") as out:
        out.write(trace.read_text())
    return message.replace(str(trace), name)


def _killed_rank(exc: ChildFailedError, error_dir: Path) -> tuple[int, int] | None:
    """(rank, signal) of a rank that a signal ended without a word of its own: the cause of its
    peers' failures (a lost connection), which torch's launcher saw first."""
    reported = {p.stem.removeprefix("rank") for p in error_dir.glob("rank*.error")}
    for rank, failure in sorted(exc.failures.items()):
        if failure.exitcode is not None and failure.exitcode < 0 and str(rank) not in reported:
            return rank, -failure.exitcode
    return None


def launch(nproc: int, job: TrainJob) -> int:
    """Start `nproc` local ranks training `job`; 0 when all of them succeed."""
    # each spawned rank reads it when torch starts: cores ÷ ranks, unless the user set it
    os.environ["OMP_NUM_THREADS"] = str(host_threads(nproc))
    if torch.cuda.is_available() and nproc > torch.cuda.device_count() and job.config.train.device != "cpu":
        raise FivefoldError(
            f"--nproc {nproc} needs {nproc} GPUs but {torch.cuda.device_count()} are visible; "
            "use --device cpu for gloo ranks on the CPU"
        )
    error_dir = Path(tempfile.mkdtemp(prefix="fivefold-ranks-"))
    watchdog = None
    received: list[int] = []
    try:
        with forward_signals(error_dir) as received, local_launcher(nproc, own_signals=True) as config:
            watchdog = Watchdog(error_dir, nproc, job.watchdog)
            try:
                elastic_launch(config, _rank_entry)(job, str(error_dir))
            finally:
                watchdog.close()
        return 0
    except ChildFailedError as exc:
        if watchdog is not None and watchdog.verdict is not None:
            print(f"fivefold train: {watchdog.verdict}", file=sys.stderr)
            return 1
        failure = _first_failure(error_dir)
        stopped = [f for f in (failure,) if f is not None and f[1] > 128]
        if received or stopped:  # a signal: the ranks stopped at a step boundary (or were killed)
            signum = received[0] if received else stopped[0][1] - 128
            message = stopped[0][2] if stopped else f"interrupted by {signal_name(signum)}"
            print(f"fivefold train: stopped: {message}", file=sys.stderr)
            return 128 + signum
        killed = _killed_rank(exc, error_dir)
        if killed is not None:
            rank, signum = killed
            print(
                f"fivefold train: rank {rank} was killed by {signal_name(signum)}; "
                "the other ranks stopped because they lost it",
                file=sys.stderr,
            )
            return 128 + signum
        if failure is None:  # died without reporting (killed, out of memory, a signal)
            rank, info = next(iter(sorted(exc.failures.items())))
            print(
                f"fivefold train: rank {rank} exited with code {info.exitcode} without a message",
                file=sys.stderr,
            )
            return 1
        rank, code, message = failure
        if code == 2:
            raise FivefoldError(f"rank {rank}: {message}") from None
        message = _keep_traceback(error_dir, rank, message)
        print(f"fivefold train: rank {rank} failed: {message}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
        if run_dir_holder(job.run_dir) is None:  # every rank has ended, and no other run writes there:
            remove_unfinished(job.run_dir)  # a .tmp left now is a dead save
