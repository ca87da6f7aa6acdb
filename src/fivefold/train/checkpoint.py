"""Checkpoints through `torch.distributed.checkpoint` (DCP): the format later layouts reshard.

A checkpoint is a directory `checkpoints/step_<N>/` holding
  * the DCP files of {"model": ..., "optim": ...}: model and optimizer state keyed by parameter
    name (`get_model_state_dict` / `get_optimizer_state_dict` with flattened optimizer keys), so
    a checkpoint written by one layout loads into another, and each model chunk of a pipeline
    rank contributes its own names;
  * `trainer.json`: the step and the training state that is not a tensor (seed, data position —
    batches are a function of (seed, step), so the step is the data state), and the model it was
    saved for (a resume or a load under an edited config.toml is refused, not misread);
  * `rng_rank<R>.pt`: each rank's torch RNG state.

Complete or absent: everything is written into `step_<N>.tmp/`; each rank then reports the files it
wrote, their sizes and CRC-32s, rank 0 records them in `shards.json` and `checksums.json` and checks
that it sees every one of them, whole, before it renames the directory to `step_<N>/` (a rename
within one directory is atomic on POSIX). Loading checks the checksums first. A rank whose files
rank 0 cannot see (a run directory that is not on storage all ranks share) fails the save instead
of leaving a checkpoint that only looks finished. A crash while saving leaves the previous
checkpoints untouched; the launcher removes a `.tmp` its ranks left when the run ended (a stale one,
from a killed launcher, goes with the next save). Only the newest `keep` checkpoints are kept, and a
checkpoint that goes (pruned, or replaced by the same step saved again) is renamed out of the
`step_<N>` namespace before it is deleted.

Resuming from `latest` takes the newest checkpoint that is whole (its index, every file the index
names, at the recorded sizes), with a warning for each newer one it has to pass over.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import sys
import time
import warnings
import zlib
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
from fivefold.train.safe_metadata import NOT_TENSORS, read_metadata, refused_as_unsafe, safe_load

_STEP_DIR = re.compile(r"^step_(\d+)$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def remove_unfinished(run_dir: Path) -> None:
    """Remove what a run that ended left of checkpoints it did not finish: `step_<N>.tmp` being
    written, `.deleting` being removed. Called once no rank writes any more."""
    root = checkpoints_root(run_dir)
    if root.is_dir():
        for left in [*root.glob("step_*.tmp"), *root.glob("step_*.deleting")]:
            _remove(left)


def _remove(path: Path) -> None:
    """Remove a checkpoint's directory, or a file or link found under a checkpoint's name (which
    `shutil.rmtree` would leave there for good)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Finished checkpoints (renamed from .tmp), oldest first."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


# how q_proj/k_proj rows are ordered for the rotary embedding (fivefold.model.attention): written into
# every checkpoint, so that weights saved in the earlier rotate-half order are refused, not misread
WEIGHT_LAYOUT = {"qk_rotary_pairs": "adjacent"}


def check_weight_layout(path: Path) -> None:
    """Refuse a checkpoint whose q/k rows follow another rotary layout than this version's."""
    try:
        state = json.loads((Path(path) / "trainer.json").read_text())
    except (OSError, ValueError):
        return  # checkpoint_problem and the loaders name an unreadable trainer.json
    if isinstance(state, dict) and all(state.get(k) == v for k, v in WEIGHT_LAYOUT.items()):
        return
    unknown = {k: state[k] for k in WEIGHT_LAYOUT if isinstance(state, dict) and state.get(k) is not None}
    if unknown:  # a value no version wrote (the earlier one wrote none): damage or a hand edit
        key, value = next(iter(unknown.items()))
        raise FivefoldError(
            f"checkpoint {path}: trainer.json's {key} is {value!r}, which no fivefold writes "
            f"(this one writes {WEIGHT_LAYOUT[key]!r}); the file was edited or damaged"
        )
    raise FivefoldError(
        f"checkpoint {path} was written by an earlier fivefold, whose q_proj/k_proj rows pair rotary "
        "features half a head apart (HF's order); this version pairs adjacent features and would "
        "read those weights wrongly. Export it to HF format with the version that wrote it "
        "(fivefold.model.hf.export_hf) and load that directory, or start a new run"
    )


# model fields a resume may change: they do not alter what the saved weights compute
RESUMABLE_MODEL_FIELDS = ("name", "max_seq_len", "init_std", "aux_loss_coef", "router_bias_rate")


def model_record(spec: Any) -> dict[str, Any]:
    """The model fields a checkpoint records (trainer.json's "model"), from a ModelSpec."""
    return {k: v for k, v in vars(spec).items() if k not in RESUMABLE_MODEL_FIELDS}


def check_model_record(path: Path, saved: Any, spec: Any, config_file: Path) -> None:
    """Refuse, naming the fields, a model that differs from the one checkpoint `path` was saved for
    (`saved`: trainer.json's "model"). Some edits keep every weight's shape and would load quietly:
    tying the head to the embedding, the rotary base, the norm's epsilon."""
    if not isinstance(saved, dict):
        return  # written before checkpoints recorded their model: the shape check is what there is
    now = model_record(spec)
    changed = [k for k in now if k in saved and saved[k] != now[k]]
    if changed:
        # each value cut to 40 characters: a crafted one stays short
        was = ", ".join(f"{k} = {json.dumps(saved[k])[:40]}" for k in changed[:3])
        now_says = ", ".join(f"{k} = {json.dumps(now[k])[:40]}" for k in changed[:3])
        raise FivefoldError(
            f"checkpoint {path} was saved for a model with {was}, but {config_file} now says {now_says}: "
            "that config.toml does not describe this checkpoint (edited since it was saved?); put its "
            "model back, or start a new run"
        )


def check_saved_model(path: Path, spec: Any, config_file: Path) -> None:
    """`check_model_record` against checkpoint `path`'s own trainer.json, for the loaders that read no
    other part of it (generate); an unreadable trainer.json is left to the weights' own checks."""
    try:
        saved = trainer_record(path).get("model")
    except ValueError:
        return
    check_model_record(path, saved, spec, config_file)


def check_model_shapes(
    path: Path, weights: dict[str, Any], stored: dict[str, Any], config_file: Path
) -> None:
    """Refuse, naming `config_file`, a model whose weights differ in shape from those checkpoint
    `path` holds (`stored`: its metadata, keyed `model.<name>`): a hand-edited config.toml, not a
    damaged checkpoint."""
    for name, tensor in weights.items():
        size = tuple(getattr(stored.get(f"model.{name}"), "size", ()))
        if size and size != tuple(tensor.shape):
            raise FivefoldError(
                f"checkpoint {path} holds {name} of shape {list(size)}, but the model in {config_file} has "
                f"{list(tensor.shape)}: that config.toml does not describe this checkpoint (edited since "
                "it was saved?); put its model back, or start a new run"
            )


def find_checkpoint(run_dir: Path, which: str = "latest", warn: bool = True) -> Path:
    """`latest` (the newest whole checkpoint), a step number, or a path to a `step_<N>` directory;
    one in an earlier weight layout is refused (`check_weight_layout`)."""
    path = _find_checkpoint(run_dir, which, warn)
    check_weight_layout(path)
    return path


def _find_checkpoint(run_dir: Path, which: str, warn: bool) -> Path:
    if which not in ("latest", "") and Path(which).is_dir():
        return _whole_or_refused(Path(which))
    found = list_checkpoints(run_dir)
    if not found:
        raise FivefoldError(
            f"no finished checkpoint (step_<N>/) in {checkpoints_root(run_dir)}; a run writes one at its "
            "end and every --checkpoint-every steps"
        )
    if which in ("latest", ""):
        skipped: list[str] = []
        for _, path in reversed(found):
            problem = checkpoint_problem(path)
            if problem is None:
                for text in skipped if warn and int(os.environ.get("RANK", "0")) == 0 else []:
                    print(f"warning: {text}; falling back to {path.name}", file=sys.stderr, flush=True)
                return path
            skipped.append(f"checkpoint {path.name} is incomplete ({problem})")
        raise FivefoldError(
            f"no whole checkpoint in {checkpoints_root(run_dir)} ({skipped[0]}); start a new run"
        )
    if which.isdigit() and (match := [p for s, p in found if s == int(which)]):
        return _whole_or_refused(match[0])
    raise FivefoldError(
        f"checkpoint {which!r} not found; available steps: {', '.join(str(s) for s, _ in found)}"
    )


def _whole_or_refused(path: Path) -> Path:
    """A checkpoint asked for by name: checked as `latest` checks its candidates, before any rank
    starts reading it, but refused rather than passed over."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise FivefoldError(
            f"checkpoint {path} is incomplete ({problem}); resume from another step_<N> directory "
            "(--resume with no step takes the newest whole one) or start a new run"
        )
    return path


def _whole(value: Any) -> bool:
    """A whole number >= 0 as JSON gives it (not true, 4.5 or 1e400)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def step_of(trainer_state: Any) -> int:
    """The step in a checkpoint's trainer.json contents (ValueError when it is not a step count)."""
    try:
        step = trainer_state["step"]
    except (KeyError, TypeError) as exc:
        raise ValueError("trainer.json is missing or unreadable") from exc
    if not _whole(step):
        raise ValueError(f"trainer.json's step {step!r} is not a step count")
    return step


def trainer_record(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer.json (ValueError when it is missing, unreadable or not an object)."""
    try:
        state = json.loads((Path(path) / "trainer.json").read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError("trainer.json is missing or unreadable") from exc
    if not isinstance(state, dict):
        raise ValueError("trainer.json is not a JSON object")
    return state


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was saved after, from its trainer.json (ValueError when that is not a
    step count: a whole number >= 0)."""
    return step_of(trainer_record(path))


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a whole checkpoint, or None. Reads only the index and the file sizes."""
    path = Path(path)
    try:
        step = checkpoint_step(path)
    except ValueError as exc:
        return str(exc)
    named = _STEP_DIR.match(path.name)
    if named and int(named.group(1)) != step:  # a trainer.json from another step: resume would redo steps
        return f"trainer.json says step {step}, its directory {path.name}"
    try:
        metadata = read_metadata(path)
    except FileNotFoundError:
        return ".metadata is missing"
    except Exception as exc:  # noqa: BLE001 - refused, truncated or not a pickle: all mean unreadable
        return f".metadata is unreadable ({(str(exc).splitlines() or [type(exc).__name__])[0][:120]})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    manifest = path / "shards.json"
    if manifest.exists():
        try:
            for files in json.loads(manifest.read_text()).values():
                for name, size in files.items():
                    if not _whole(size):
                        raise ValueError(f"size {size!r}")
                    needed[name] = max(needed.get(name, 0), size)
        except (OSError, ValueError, AttributeError, TypeError, RecursionError):
            return "shards.json is unreadable"
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"shard {name} is missing"
        if file.stat().st_size < size:
            return f"shard {name} is {file.stat().st_size} bytes, {size} were written"
    return None


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
    unmade = None
    if rank == 0:
        try:
            remove_unfinished(run_dir)  # this step's .tmp, and whatever a killed launcher left
            tmp.mkdir(parents=True)
        except OSError as exc:  # storage gone read-only, a full disk: said as any other failed save
            unmade = _first_cause(exc)
    unmade = broadcast_object(unmade)  # every rank waits for the directory, and learns if there is none
    if unmade is not None:
        raise _unwritten(final, tmp, rank, unmade)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # one process
            dcp.save(_state(model_parts, optimizers), checkpoint_id=str(tmp))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, tmp / f"rng_rank{rank}.pt")
    except (OSError, CheckpointException) as exc:  # a full disk, a quota, storage gone read-only
        raise _unwritten(final, tmp, rank, _first_cause(exc)) from None
    own = _own_files(tmp, rank)
    shards = _gather(own)  # every rank's files as it sees them: names and sizes
    # each rank reads back its own files; rank 0 also wrote DCP's index
    sums = _gather(_checksums(tmp, [*own, *([".metadata"] if rank == 0 else [])]))
    problem = unwritten = None
    if rank == 0:
        try:
            (tmp / "shards.json").write_text(json.dumps({str(r): f for r, f in enumerate(shards)}, indent=1))
            (tmp / CHECKSUMS).write_text(json.dumps({k: v for own in sums for k, v in own.items()}, indent=1))
        except OSError as exc:
            unwritten = _first_cause(exc)
        else:
            problem = _unseen(tmp, shards)
    problem, unwritten = broadcast_object((problem, unwritten))
    if unwritten is not None:
        raise _unwritten(final, tmp, rank, unwritten)
    if problem is not None:
        raise FivefoldError(
            f"checkpoint {final.name} is incomplete from rank 0's view: {problem}; the run directory "
            f"must be on storage every rank shares (the previous checkpoint is kept)"
        )
    if rank == 0:
        try:
            (tmp / "trainer.json").write_text(
                json.dumps(dict(trainer_state, step=step, **WEIGHT_LAYOUT), indent=1)
            )
        except OSError as exc:
            raise _unwritten(final, tmp, rank, _first_cause(exc)) from None
        replaced = _retire(final) if final.exists() else None  # the same step saved again
        os.replace(tmp, final)
        _fsync_dir(root)
        gone = [_retire(old) for _, old in (list_checkpoints(run_dir)[:-keep] if keep > 0 else [])]
        for old in [replaced, *gone]:
            if old is not None:
                _remove(old)
    _barrier()
    return final


class CheckpointUnwritten(FivefoldError):
    """A checkpoint the storage would not take: a fault of the run, not bad input (exit code 1)."""

    exit_code = 1


def _unwritten(final: Path, tmp: Path, rank: int, why: str) -> CheckpointUnwritten:
    """The one line for a checkpoint that could not be written (`why`: the storage's reason); rank 0
    removes what was written of it, which frees the space it took (resume never reads a `.tmp`, and
    the previous checkpoint stays)."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    # the run's first checkpoint leaves nothing to resume from: said so, not "resume"
    fix = "free space (or fix the storage) and"
    if any(path != final for _, path in list_checkpoints(final.parent.parent)):
        after = f"earlier checkpoints are kept and the run stopped: {fix} resume"
    else:
        after = f"the run stopped with no checkpoint to resume from: {fix} start it again"
    return CheckpointUnwritten(f"checkpoint {final} could not be written ({why}); {after}")


CHECKSUMS = "checksums.json"  # {file: crc32} of every file the ranks wrote
_CHUNK = 1 << 23


def _checksums(directory: Path, names: list[str]) -> dict[str, int]:
    """CRC-32 of each file: what a same-size corruption (a flipped bit, an overwritten block) changes,
    which the recorded sizes cannot see."""
    sums = {}
    for name in names:
        crc = 0
        try:
            with (directory / name).open("rb") as fh:
                while chunk := fh.read(_CHUNK):
                    crc = zlib.crc32(chunk, crc)
        except FileNotFoundError:  # gone since it was listed: the size check names it
            continue
        sums[name] = crc
    return sums


def damaged_file(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """The first file of this rank's share (every world-th of them, so the ranks read the checkpoint
    once between them) whose CRC-32 is not the one it was written with, or None. A checkpoint
    written before checksums were recorded has nothing to check."""
    manifest = Path(path) / CHECKSUMS
    if not manifest.exists():
        return None
    try:
        recorded = json.loads(manifest.read_text())
        names = sorted(recorded)[rank::world]
        expected = {name: int(recorded[name]) for name in names}
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return f"{CHECKSUMS} is unreadable"
    for name in names:
        if Path(name).name != name:  # a crafted manifest must not read files elsewhere
            return f"{CHECKSUMS} names {name!r}, not a file of the checkpoint"
        try:
            got = _checksums(Path(path), [name]).get(name)
        except OSError:
            got = None
        if got is None:
            return f"shard {name} is missing or unreadable"
        if got != expected[name]:
            return f"shard {name} does not match the checksum it was written with"
    return None


def first_problem_of_all(problem: str | None) -> str | None:
    """Collective where ranks are: the first problem any rank found, on every rank. A refusal only
    some ranks raise would leave their peers waiting for them in the next collective."""
    return next((p for p in _gather(problem) if p), None)


def check_not_damaged(path: Path, remedy: str) -> None:
    """Collective where ranks are: every rank checks its share, and all refuse if one file is off."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    problem = first_problem_of_all(damaged_file(path, _rank(), world))
    if problem:
        raise FivefoldError(f"checkpoint {path} is damaged: {problem}; {remedy}")


def _own_files(directory: Path, rank: int) -> dict[str, int]:
    """The files this rank wrote into a checkpoint directory (DCP names them `__<rank>_<i>.distcp`)."""
    own = [
        p for p in directory.iterdir() if p.name.startswith(f"__{rank}_") or p.name == f"rng_rank{rank}.pt"
    ]
    return {p.name: p.stat().st_size for p in sorted(own)}


def _unseen(directory: Path, shards: list[dict[str, int]]) -> str | None:
    """The first file some rank wrote that rank 0 does not see whole."""
    for r, files in enumerate(shards):
        if not files:
            return f"rank {r} reported no files"
        for name, size in files.items():
            file = directory / name
            if not file.is_file():
                return f"rank {r}'s {name} is not there"
            if file.stat().st_size != size:
                return f"rank {r}'s {name} is {file.stat().st_size} bytes, {size} were written"
    return None


def _retire(path: Path) -> Path:
    """Move a finished checkpoint out of the `step_<N>` names first: a kill while deleting it then
    leaves a directory nothing will mistake for a checkpoint."""
    gone = path.with_name(f"{path.name}.{time.time_ns()}.deleting")
    os.replace(path, gone)
    return gone


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every rank (itself in a single process)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_checkpoint(
    path: Path, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> dict[str, Any]:
    """Load model + optimizer state in place (any layout); returns `trainer.json`'s contents."""
    path = Path(path)
    meta_file = path / "trainer.json"
    check_weight_layout(path)

    def corrupt(exc: BaseException) -> FivefoldError:
        return FivefoldError(
            f"checkpoint {path} is corrupt or incomplete ({_first_cause(exc)[:200]}); resume from another "
            f"step_<N> directory or start a new run"
        )

    try:
        trainer_state = json.loads(meta_file.read_text())
        step = step_of(trainer_state)
        if not (path / ".metadata").exists():
            raise FileNotFoundError(f"{path / '.metadata'} is missing")
        stored = read_metadata(path).state_dict_metadata
        state = _state(model_parts, optimizers)
    except (Exception, CheckpointException) as exc:  # DCP raises several kinds; all mean the same here
        raise corrupt(exc) from None
    # a model of another shape is the run's config.toml edited since, not a damaged checkpoint
    config_file = path.parent.parent / "config.toml"
    check_model_record(path, trainer_state.get("model"), model_parts[0].spec, config_file)
    check_model_shapes(path, state["model"], stored, config_file)
    check_not_damaged(path, "resume from an earlier step_<N> (--resume STEP) or start a new run")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            safe_load(state, path)
    except (Exception, CheckpointException) as exc:
        raise corrupt(exc) from None
    for part, opt in zip(model_parts, optimizers, strict=True):
        names = set(get_model_state_dict(part))
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in names})
        kernels = [{k: g.get(k) for k in ("fused", "foreach")} for g in opt.param_groups]
        set_optimizer_state_dict(part, opt, state["optim"], options=_OPTIONS)
        _keep_kernels(opt, kernels)
    rng_file = path / f"rng_rank{_rank()}.pt"
    if rng_file.exists():
        _restore_rng(rng_file)
    trainer_state["step"] = step
    return trainer_state


def _keep_kernels(optimizer: torch.optim.Optimizer, groups_before: list[dict]) -> None:
    """Put back the implementation this layout chose after a checkpoint's param groups were
    loaded: the run that saved them may have had another layout, and another choice."""
    targets = [optimizer.param_groups]
    inner = getattr(optimizer, "optim", None)  # ZeRO's local optimizer keeps its own groups
    if inner is not None:
        targets.append(inner.param_groups)
    for param_groups in targets:
        for group, before in zip(param_groups, groups_before, strict=False):
            group["fused"], group["foreach"] = before.get("fused"), before.get("foreach")


def _restore_rng(rng_file: Path) -> None:
    """Each rank's RNG state: tensors only (`weights_only`), checked before it is applied."""
    try:
        with warnings.catch_warnings():  # torch's warning about a crafted file's pickle protocol: noise here
            warnings.simplefilter("ignore")
            rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    except Exception as exc:  # noqa: BLE001 - unreadable, refused or the wrong shape: all mean corrupt
        # torch's own message about a refused file advises turning the safety off: not repeated here
        if isinstance(exc, pickle.UnpicklingError) and refused_as_unsafe(exc):
            reason = "it holds objects other than tensors, which are not loaded"
        else:
            reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:100]}"
        raise FivefoldError(
            f"RNG state {rng_file} is corrupt or not a fivefold RNG file ({reason}); "
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
    if refused_as_unsafe(exc):  # torch's message ends in a pointer to its docs, not in a reason
        return NOT_TENSORS
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if isinstance(exc, CheckpointException) and lines:
        return lines[-1]
    return lines[0] if lines else type(exc).__name__
