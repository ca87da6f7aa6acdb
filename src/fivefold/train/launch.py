"""`fivefold train --nproc N`: N local ranks through torch's own elastic launcher.

Rendezvous is c10d on localhost with an OS-chosen port (as `torchrun --standalone` does). Each rank
gets the resolved `TrainJob` as data (pickled by the spawn) and trains it in-process; gloo on CPU,
NCCL on GPU (chosen by the loop from the device). Nothing is parsed again in the ranks.

Failures surface once: a rank that fails writes its one-line reason to a shared folder and exits
non-zero; the launcher stops the other ranks, and the parent reports the first failure — a
`FivefoldError` (exit code 2) for bad input, otherwise the exception with the path of its
traceback (exit code 1). The launcher's own log chatter is silenced.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch

from fivefold.config import RunConfig
from fivefold.errors import FivefoldError
from fivefold.parallel.spawn import local_launch_config, quiet_launcher, threads_per_rank
from fivefold.train.loop import train


@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs to train: the validated config and where the run lives."""

    config: RunConfig
    run_dir: Path
    resume: str | None = None  # None: a new run; "latest" or a step number: continue
    progress: bool = True


def run_job(job: TrainJob) -> int:
    """Train `job` in this process: alone, or as one rank of a launched world."""
    result = train(job.config, job.run_dir, resume=job.resume, progress=job.progress)
    if int(os.environ.get("RANK", "0")) == 0:
        held = f"; held-out loss {result.held_out_loss:.4f}" if result.held_out_loss is not None else ""
        print(f"run directory: {result.run_dir}{held}")
    return 0


def _rank_entry(job: TrainJob, error_dir: str) -> int:
    """Runs in each spawned rank."""
    rank = os.environ.get("RANK", "?")
    try:
        return run_job(job)
    except FivefoldError as exc:
        _report(error_dir, rank, 2, str(exc))
        sys.exit(2)
    except BaseException as exc:  # noqa: BLE001 - anything else is reported with its traceback
        trace = Path(error_dir) / f"rank{rank}.traceback"
        trace.write_text(traceback.format_exc())
        _report(error_dir, rank, 1, f"{type(exc).__name__}: {exc}".splitlines()[0] + f" (traceback: {trace})")
        sys.exit(1)


def _report(error_dir: str, rank: str, code: int, message: str) -> None:
    path = Path(error_dir) / f"rank{rank}.error"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{code}\n{message}")
    os.replace(tmp, path)  # whole or absent: the parent never reads half a message


def _first_failure(error_dir: Path) -> tuple[int, int, str] | None:
    """(rank, code, message) of the earliest reported failure: the cause, not its echoes."""
    reports = sorted(error_dir.glob("rank*.error"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    for path in reports:
        code, _, message = path.read_text().partition("\n")
        rank = path.stem.removeprefix("rank")
        return (int(rank) if rank.isdigit() else -1), int(code), message
    return None


def launch(nproc: int, job: TrainJob) -> int:
    """Start `nproc` local ranks training `job`; 0 when all of them succeed."""
    # each spawned rank reads it when torch starts: cores ÷ ranks, unless the user set it
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(nproc))
    if torch.cuda.is_available() and nproc > torch.cuda.device_count() and job.config.train.device != "cpu":
        raise FivefoldError(
            f"--nproc {nproc} needs {nproc} GPUs but {torch.cuda.device_count()} are visible; "
            "use --device cpu for gloo ranks on the CPU"
        )
    error_dir = Path(tempfile.mkdtemp(prefix="fivefold-ranks-"))
    keep_errors = False
    try:
        with quiet_launcher():
            elastic_launch(local_launch_config(nproc), _rank_entry)(job, str(error_dir))
        return 0
    except ChildFailedError as exc:
        failure = _first_failure(error_dir)
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
        keep_errors = True
        print(f"fivefold train: rank {rank} failed: {message}", file=sys.stderr)
        return 1
    finally:
        if not keep_errors:
            shutil.rmtree(error_dir, ignore_errors=True)
