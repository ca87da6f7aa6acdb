"""Checkpoints through `torch.distributed.checkpoint` (DCP): the format later layouts reshard.

A checkpoint is a directory `checkpoints/step_<N>/` holding
  * the DCP files of {"model": ..., "optim": ...}: model and optimizer state keyed by parameter
    name (`get_model_state_dict` / `get_optimizer_state_dict` with flattened optimizer keys), so
    a checkpoint written by one layout loads into another, and each model chunk of a pipeline
    rank contributes its own names;
  * `trainer.json`: the step and the training state that is not a tensor (seed, data position —
    batches are a function of (seed, step), so the step is the data state);
  * `rng_rank<R>.pt`: each rank's torch RNG state.

Atomic: everything is written into `step_<N>.tmp/`, and only when every rank has finished does
rank 0 rename it to `step_<N>/` (a rename within one directory is atomic on POSIX). A crash while
saving leaves the previous checkpoints untouched; a stale `.tmp` is removed by the next save.
Only the newest `keep` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fivefold.errors import FivefoldError
from fivefold.train.safe_metadata import safe_load

_STEP_DIR = re.compile(r"^step_(\d+)$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Finished checkpoints (renamed from .tmp), oldest first."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def find_checkpoint(run_dir: Path, which: str = "latest") -> Path:
    """`latest`, a step number, or a path to a `step_<N>` directory."""
    if which not in ("latest", "") and Path(which).is_dir():
        return Path(which)
    found = list_checkpoints(run_dir)
    if not found:
        raise FivefoldError(f"no checkpoint to resume from in {checkpoints_root(run_dir)}")
    if which in ("latest", ""):
        return found[-1][1]
    if which.isdigit() and (match := [p for s, p in found if s == int(which)]):
        return match[0]
    raise FivefoldError(
        f"checkpoint {which!r} not found; available steps: {', '.join(str(s) for s, _ in found)}"
    )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _state(model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for part, opt in zip(model_parts, optimizers, strict=True):
        model.update(get_model_state_dict(part))
        optim.update(get_optimizer_state_dict(part, opt, options=_OPTIONS))
    return {"model": model, "optim": optim}


def save_checkpoint(
    run_dir: Path,
    step: int,
    model_parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    trainer_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Collective: every rank calls it. Returns the final `step_<N>` directory."""
    root = checkpoints_root(run_dir)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # one process: fine
        dcp.save(_state(model_parts, optimizers), checkpoint_id=str(tmp))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / f"rng_rank{rank}.pt")
    _barrier()
    if rank == 0:
        (tmp / "trainer.json").write_text(json.dumps(dict(trainer_state, step=step), indent=1))
        if final.exists():  # the same step saved again (a resumed run repeating it)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(
    path: Path, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> dict[str, Any]:
    """Load model + optimizer state in place (any layout); returns `trainer.json`'s contents."""
    path = Path(path)
    meta_file = path / "trainer.json"
    try:
        trainer_state = json.loads(meta_file.read_text())
        step = int(trainer_state["step"])
        if not (path / ".metadata").exists():
            raise FileNotFoundError(f"{path / '.metadata'} is missing")
        state = _state(model_parts, optimizers)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            safe_load(state, path)
    except (Exception, CheckpointException) as exc:  # DCP raises several kinds; all mean the same here
        detail = _first_cause(exc)
        raise FivefoldError(
            f"checkpoint {path} is corrupt or incomplete ({detail[:200]}); resume from another "
            f"step_<N> directory or start a new run"
        ) from None
    for part, opt in zip(model_parts, optimizers, strict=True):
        names = set(get_model_state_dict(part))
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in names})
        set_optimizer_state_dict(part, opt, state["optim"], options=_OPTIONS)
    rng_file = path / f"rng_rank{_rank()}.pt"
    if rng_file.exists():
        _restore_rng(rng_file)
    trainer_state["step"] = step
    return trainer_state


def _restore_rng(rng_file: Path) -> None:
    """Each rank's RNG state: tensors only (`weights_only`), checked before it is applied."""
    try:
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    except Exception as exc:  # noqa: BLE001 - unreadable, refused or the wrong shape: all mean corrupt
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FivefoldError(
            f"RNG state {rng_file} is corrupt or not a fivefold RNG file ({reason[:120]}); "
            f"resume from another step_<N> directory or start a new run"
        ) from None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_cause(exc: BaseException) -> str:
    """A one-line reason; DCP wraps each rank's traceback, whose last line says what went wrong."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if isinstance(exc, CheckpointException) and lines:
        return lines[-1]
    return lines[0] if lines else type(exc).__name__
