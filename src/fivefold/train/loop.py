"""The training loop: one code path for every layout.

The loop owns data, optimizer, learning-rate schedule, metrics and checkpoints; a `StepRunner`
owns how this rank's share of a batch becomes gradients (`fivefold.parallel.api`). One process
uses the single-device `LocalRunner`; several ranks use the runner that
`fivefold.parallel.runners.build_runner` builds for the layout. Nothing here looks at which axes
are split, except to pick this rank's share of the batch (its `batch` coordinate).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fivefold.config import Layout, ModelSpec, RunConfig, TrainSpec, check_buildable, check_seq_len
from fivefold.errors import FivefoldError, StorageFault, storage_fault
from fivefold.layout_math import numel, param_shapes
from fivefold.measure.ledger import CommLedger
from fivefold.measure.memory import ActivationMeter, device_memory, state_bytes
from fivefold.measure.timeline import write_trace
from fivefold.model import build_model, materialize
from fivefold.model.hf import first_non_finite
from fivefold.outputs import write_text_whole
from fivefold.parallel import runners
from fivefold.parallel.api import LocalRunner
from fivefold.parallel.compile import check_compile, compile_blocks
from fivefold.parallel.device_mesh import build_runtime_mesh
from fivefold.parallel.pipeline import check_pipeline_batch
from fivefold.parallel.recompute import apply_recompute
from fivefold.support import check_trainable
from fivefold.train import supervise
from fivefold.train.checkpoint import (
    broadcast_object,
    check_saved_model,
    checkpoint_step,
    checkpoints_root,
    find_checkpoint,
    first_problem_of_all,
    load_checkpoint,
    model_record,
    save_checkpoint,
)
from fivefold.train.data import (
    EVAL_STREAM,
    BatchPrefetcher,
    TokenData,
    check_data_source,
    load_data,
    sample_batch,
)
from fivefold.train.host_memory import keep_freed_memory, physical_bytes
from fivefold.train.metrics import MetricsLog, MfuMeter
from fivefold.train.plots import plot_loss_curve
from fivefold.train.tokenizer import load_tokenizer
from fivefold.train.trace import Tracer, merge_trace_parts, torch_profile

KEEP_CHECKPOINTS = 2


@dataclass
class TrainResult:
    run_dir: Path
    layout: Layout
    losses: list[float] = field(default_factory=list)  # one per step run in this call
    held_out_loss: float | None = None
    first_step: int = 1


# --------------------------------------------------------------------------------------------
# pieces


def lr_at(step: int, train: TrainSpec) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `lr × min_lr_ratio`."""
    if train.warmup_steps > 0 and step <= train.warmup_steps:
        return train.lr * step / train.warmup_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps))
    low = train.lr * train.min_lr_ratio
    return low + 0.5 * (train.lr - low) * (1.0 + math.cos(math.pi * progress))


def resolve_device(train: TrainSpec) -> torch.device:
    want = train.device
    if want not in ("auto", "cpu", "cuda"):
        raise FivefoldError(f"device must be auto, cpu or cuda, got {want!r}")
    if want == "cuda" and not torch.cuda.is_available():
        raise FivefoldError("device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_distributed(device: torch.device) -> bool:
    """Join the process group a launcher described in the environment; True if we created it."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10)
    )
    return True


def runtime_layout(layout: Layout, world: int, model: ModelSpec, seq_len: int) -> Layout:
    """The layout a training run uses: resolved (the flags left out read as `layout_from_args` reads
    them for every command: dp -1 fills the world) and checked (`check_trainable`, the planner's check
    too) before any rank starts."""
    layout.check_experts(model)
    lay = layout.resolve(world)
    check_trainable(model, lay, seq_len)
    check_seq_len(model, seq_len)
    return lay


def preflight(cfg: RunConfig, run_dir: Path, resume: str | None, world: int) -> None:
    """What can be checked before any rank starts, so bad input never costs a launch."""
    if (holder := run_dir_holder(Path(run_dir))) is not None:  # first: what else is found there is its
        raise _in_use(Path(run_dir), holder)
    spec, tspec = cfg.model.validate(), cfg.train.validate()
    check_buildable(spec)
    layout = runtime_layout(cfg.layout, world, spec, tspec.seq_len)
    tspec.grad_accum(layout.dp * layout.fsdp)
    if layout.pp > 1:  # the batch against --microbatches, which the ranks would find only after a launch
        check_pipeline_batch(layout, tspec)
    if tspec.device == "cuda" and not torch.cuda.is_available():
        raise FivefoldError("device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    check_data_source(tspec.data)
    check_model_state_fits(spec, tspec, world)
    check_batch_fits(spec, tspec, layout, world)
    if resume is not None and checkpoints_root(run_dir).is_dir():
        # a config.toml edited since the checkpoint is named as such before its consequences (a
        # vocabulary the tokenizer no longer fits) are
        check_saved_model(find_checkpoint(run_dir, resume, warn=False), spec, run_dir / "config.toml")
    tokenizer = load_tokenizer(tspec.tokenizer)
    if tokenizer.vocab_size > spec.vocab:
        raise FivefoldError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but model "
            f"{spec.name} only {spec.vocab}; pick a model with vocab >= {tokenizer.vocab_size}"
        )
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 speaks for the run directory
        if resume is not None:
            # a resume with nothing left to train would only rewrite the run's files: refused first
            done = checkpoint_step(find_checkpoint(run_dir, resume, warn=False))
            if done >= tspec.steps:
                raise FivefoldError(
                    f"the checkpoint is at step {done}, at or past --steps {tspec.steps}: nothing to train; "
                    f"give --steps above {done} to continue the run"
                )
        check_run_dir(run_dir, resume)


# fp32 weights, their gradients and Adam's two moments: what every parameter costs at the least, however
# it is sharded (bf16 adds a compute copy on top)
STATE_BYTES_PER_PARAM = 16


def _ranks_here(world: int) -> int:
    """Ranks that share this machine's memory: torchrun's local world, else every rank (spawned here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) if "RANK" in os.environ else world


def check_model_state_fits(spec: ModelSpec, tspec: TrainSpec, world: int) -> None:
    """Refuse, before any rank allocates, a model whose weights, gradients and optimizer state alone
    exceed this machine's memory even spread evenly over every rank (the least any layout can hold);
    activations and buffers come on top, so a run that passes may still run out."""
    params = sum(numel(shape) for shape in param_shapes(spec).values())
    local = _ranks_here(world)
    if tspec.device == "cuda":
        have = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        need, where = STATE_BYTES_PER_PARAM * params / world, "a GPU's memory"
    else:
        have = physical_bytes()
        need, where = STATE_BYTES_PER_PARAM * params * local / world, f"this machine's {have / 1e9:.1f} GB"
    if need > have:
        raise FivefoldError(
            f"model {spec.name} has {params / 1e9:,.2f}B parameters: their weights, gradients and Adam "
            f"state take {STATE_BYTES_PER_PARAM} bytes each, {need / 1e9:,.1f} GB even spread over the "
            f"{world} rank(s), more than {where}; train a smaller model, or size a layout for it first "
            "with `fivefold plan --search`"
        )


def check_batch_fits(spec: ModelSpec, tspec: TrainSpec, layout: Layout, world: int) -> None:
    """Refuse, before any rank allocates, a batch whose token windows (int64, a data rank's whole share
    of the step, sampled at once) and one micro-batch's fp32 logits alone exceed this machine's memory:
    `--micro-batch 99999999` would otherwise end in the kernel's out-of-memory kill, not a message."""
    data_ranks = layout.dp * layout.fsdp
    rows = tspec.step_batch(data_ranks) // data_ranks
    windows = rows * (tspec.seq_len + 1) * 8
    logits = tspec.micro_batch * tspec.seq_len * spec.vocab * 4 // (layout.tp * layout.cp)
    local, have = _ranks_here(world), physical_bytes()
    if (windows + logits) * local > have:
        raise FivefoldError(
            f"--micro-batch {tspec.micro_batch} × --seq-len {tspec.seq_len} (global batch "
            f"{rows * data_ranks}): a rank's token windows and one micro-batch's logits alone take "
            f"{(windows + logits) / 1e9:,.1f} GB, {(windows + logits) * local / 1e9:,.1f} GB over the "
            f"{local} rank(s) here, more than this machine's {have / 1e9:.1f} GB; lower --micro-batch, "
            "--global-batch or --seq-len"
        )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# --------------------------------------------------------------------------------------------
# the loop


def build_runner(
    model: torch.nn.Module, layout: Layout, train: TrainSpec, device: torch.device
) -> tuple[Any, Any]:
    """(runner, runtime mesh) for this world; the mesh is None for a single process."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        materialize(model, device, train.seed)
        apply_recompute(model, layout.recompute, layout.recompute_layers)
        if train.compile:
            compile_blocks(model)
        return LocalRunner(model, train.micro_batch, train), None
    mesh = build_runtime_mesh(layout, device.type)
    return runners.build_runner(model, mesh, layout, train), mesh


# what a run writes into its directory: a new run never replaces any of these
RUN_FILES = (
    "config.toml",
    "metrics.jsonl",
    "trace.json",
    "ledger.json",
    "loss.png",
    "run.json",
    "checkpoints",
)


def check_run_dir(
    run_dir: Path, resume: str | None, to_continue: str = "pass --resume to continue it"
) -> None:
    """A new run goes into an empty place: never over another run or files someone else wrote.
    `to_continue` says how a run found there is continued (a command without --resume says its own)."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():  # found here, not as mkdir's "File exists" in a rank
        raise FivefoldError(f"--run-dir {run_dir} exists and is not a directory; pick another --run-dir")
    if run_dir.is_symlink() and not run_dir.exists():
        raise FivefoldError(
            f"--run-dir {run_dir} is a link that leads nowhere (or back to itself); pick another --run-dir"
        )
    if (holder := run_dir_holder(run_dir)) is not None:
        raise _in_use(run_dir, holder)
    if resume is not None:
        _check_resumable(run_dir)
        return
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise FivefoldError(f"{run_dir} already holds a run; {to_continue} or pick another --run-dir")
    if present := [name for name in RUN_FILES if (run_dir / name).exists()]:
        raise FivefoldError(
            f"{run_dir} already has {', '.join(present)}, which a new run would overwrite; "
            "pick another --run-dir or move those files"
        )


def _check_resumable(run_dir: Path) -> None:
    """The files a resumed run rewrites at its end are files it can write, and the metrics it keeps
    are text: found now, not after the steps have run."""
    for name in RUN_FILES:
        if name != "checkpoints" and (run_dir / name).exists() and not (run_dir / name).is_file():
            raise FivefoldError(
                f"{run_dir / name} is not a file; a resumed run rewrites it: move it away to resume"
            )
    metrics = run_dir / "metrics.jsonl"
    try:
        if metrics.exists():
            metrics.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise FivefoldError(f"cannot read {metrics}, which a resumed run continues: {exc}") from None


def _on_rank0(run_dir: Path, write: Callable[[], None], rank: int) -> None:
    """Rank 0 runs `write` in the run directory; every rank learns the outcome and fails alike: bad
    input with exit code 2, storage that refused the write (a full disk) with 1."""
    problem = None
    if rank == 0:
        try:
            write()
        except FivefoldError as exc:
            problem = (str(exc), exc.exit_code)
        except OSError as exc:
            full = storage_fault(exc, run_dir)
            problem = (full, 1) if full else (f"cannot write the run directory {run_dir}: {exc}", 2)
    problem = broadcast_object(problem)
    if problem is not None:
        text, code = problem
        raise (StorageFault if code == 1 else FivefoldError)(text)


def _setup_run_dir(run_dir: Path, cfg: RunConfig, resume: str | None, rank: int) -> None:
    """Rank 0 checks and writes; every rank learns the outcome (a rank that checked after rank 0
    wrote `config.toml` would take the run for someone else's). A resumed run's `config.toml` is
    rewritten once its checkpoint has loaded (`_record_config`): a resume that fails leaves it as it was."""

    def setup() -> None:
        check_run_dir(run_dir, resume)
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume is None:  # whole or not at all: a cut config.toml would block the run's retry
            write_text_whole(run_dir / "config.toml", cfg.to_toml(), "output")

    _on_rank0(run_dir, setup, rank)


def _record_config(run_dir: Path, cfg: RunConfig, rank: int) -> None:
    """Rank 0 writes the resumed run's settings (its new --steps, layout) over `config.toml`."""

    def record() -> None:
        write_text_whole(run_dir / "config.toml", cfg.to_toml(), "output")

    _on_rank0(run_dir, record, rank)


def _check_shared(run_dir: Path, rank: int, world: int) -> None:
    """Every rank must see the run directory rank 0 writes: checkpoints are assembled there."""
    if world == 1:
        return
    token = run_dir / ".fivefold-shared"
    stamp = f"{os.getpid()}-{time.time_ns()}"
    if rank == 0:
        token.write_text(broadcast_object(stamp))
    else:
        stamp = broadcast_object(None)
    _barrier()
    try:
        seen = token.read_text() == stamp
    except OSError:
        seen = False
    blind = [r for r, ok in enumerate(_gather(seen)) if not ok]
    _barrier()
    if rank == 0:
        token.unlink(missing_ok=True)
    if blind:
        raise FivefoldError(
            f"rank(s) {', '.join(map(str, blind))} do not see the run directory {run_dir} that rank 0 "
            "writes; put --run-dir on storage every node shares"
        )


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def evaluate(
    runner: Any,
    data: TokenData,
    train: TrainSpec,
    global_batch: int,
    rank: int,
    ranks: int,
    device: torch.device,
) -> float:
    """Mean loss over `eval_batches` fixed held-out batches (the same ones at every evaluation)."""
    losses = []
    for i in range(train.eval_batches):
        x, y = sample_batch(
            data.held_out, train.seq_len, global_batch, train.seed, i, rank, ranks, EVAL_STREAM
        )
        losses.append(float(runner.eval_loss(x.to(device), y.to(device))))
    return sum(losses) / len(losses)


def train(
    cfg: RunConfig,
    run_dir: str | Path,
    resume: str | None = None,
    progress: bool = True,
    control_folder: str | None = None,
    checkpoint_on_interrupt: bool = False,
    heartbeat: bool = True,
) -> TrainResult:
    """Train `cfg` in this process (one rank of a launched world, or alone) and fill `run_dir`.

    SIGINT/SIGTERM stop it after the current step (`supervise.Interrupted`), with a checkpoint
    first when `checkpoint_on_interrupt`. `control_folder`: where the launcher's stop file appears
    and, with `heartbeat`, where its watchdog reads this rank's heartbeat.
    """
    spec, train_spec = cfg.model.validate(), cfg.train.validate()
    device = resolve_device(train_spec)
    if device.type == "cpu":
        keep_freed_memory()  # no page faults on each step's fresh tensors (host_memory.py)
    rank = int(os.environ.get("RANK", "0"))
    with supervise.rank_supervision(control_folder, rank, heartbeat):
        supervise.mark(0, "joining the process group")
        created_group = init_distributed(device)
        lock = None
        try:
            lock = _lock_run_dir(Path(run_dir), rank, resume)
            return _train(
                cfg, spec, train_spec, Path(run_dir), resume, device, progress, checkpoint_on_interrupt
            )
        finally:
            if lock is not None:
                os.close(lock)  # and with it the lock
            if created_group and dist.is_initialized():
                dist.destroy_process_group()


LOCK_FILE = ".fivefold-lock"


def _lock_run_dir(run_dir: Path, rank: int, resume: str | None) -> int | None:
    """Collective: rank 0 takes an exclusive lock on the run directory for the run's life, and every
    rank learns whether it got it. A second `train` into the directory (a resume while the run goes
    on, a new run started beside it) is refused, not interleaved with it: their metrics and
    checkpoints would mix. The lock goes with the process, also when it is killed. Returns the
    lock's file descriptor (rank 0), or None where nothing is held: other ranks, a directory a new
    run cannot make or a resume does not find (the run's checks say why), a file system without
    locks (some network mounts)."""
    held, holder = None, None
    usable = run_dir.is_dir() if resume is not None or run_dir.exists() else True
    if rank == 0 and usable:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            held = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            held = None
        if held is not None:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.ftruncate(held, 0)
                os.pwrite(held, str(os.getpid()).encode(), 0)
            except BlockingIOError:  # another process holds it: its pid is in the file
                holder = _pid_in(held)
                os.close(held)
                held = None
            except OSError:  # no locks on this file system: run unlocked
                os.close(held)
                held = None
    holder = broadcast_object(holder)
    if holder is not None:
        raise _in_use(run_dir, holder)
    return held


def run_dir_holder(run_dir: Path) -> str | None:
    """The pid of another `train` holding the run directory's lock, or None where none does (asked
    before a run starts, so that its first word is this, not what the running one left half-done)."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        holder = _pid_in(fd)
        return None if holder == str(os.getpid()) else holder  # this run's own lock
    except OSError:  # no locks on this file system
        return None
    finally:
        os.close(fd)  # and any shared lock taken


def _pid_in(fd: int) -> str:
    """The pid the lock's holder wrote into the lock file."""
    return os.pread(fd, 20, 0).decode(errors="replace").strip() or "unknown"


def _in_use(run_dir: Path, holder: str) -> FivefoldError:
    return FivefoldError(
        f"{run_dir} is in use by another fivefold train (pid {holder}); wait for it to end, or pick "
        "another --run-dir"
    )


def _stop_signal(device: torch.device) -> int:
    """The signal every rank agrees to stop for (the same answer on all of them), or 0."""
    signum = supervise.stop_requested()
    if not dist.is_initialized():
        return signum
    flag = torch.tensor([signum], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _train(
    cfg: RunConfig,
    spec: Any,
    tspec: TrainSpec,
    run_dir: Path,
    resume: str | None,
    device: torch.device,
    progress: bool,
    checkpoint_on_interrupt: bool = False,
) -> TrainResult:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = runtime_layout(cfg.layout, world, spec, tspec.seq_len)
    if tspec.compile:
        check_compile(layout)
    data_ranks = layout.dp * layout.fsdp
    accum = tspec.grad_accum(data_ranks)
    global_batch = tspec.micro_batch * data_ranks * accum
    tspec = replace(tspec, global_batch=global_batch)
    tokenizer = load_tokenizer(tspec.tokenizer)
    if tokenizer.vocab_size > spec.vocab:
        raise FivefoldError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but model "
            f"{spec.name} only {spec.vocab}; pick a model with vocab >= {tokenizer.vocab_size}"
        )
    supervise.mark(0, "reading the data")
    data = load_data(tspec.data, tokenizer, tspec.seq_len)  # bad data fails before anything is written
    if data.max_token >= spec.vocab:
        raise FivefoldError(
            f"data {tspec.data} holds token id {data.max_token}, outside the model's vocab {spec.vocab}"
        )
    run_dir = Path(broadcast_object(str(run_dir)))
    checkpoint = None
    if resume is not None:  # rank 0 picks (and warns about skipped ones); every rank loads the same
        checkpoint = Path(broadcast_object(str(find_checkpoint(run_dir, resume, warn=rank == 0))))
    resolved = RunConfig(model=spec, train=tspec, layout=layout)
    _setup_run_dir(run_dir, resolved, resume, rank)
    _barrier()
    _check_shared(run_dir, rank, world)

    supervise.mark(0, "building the model")
    torch.manual_seed(tspec.seed)
    tracer = Tracer(rank)
    model = build_model(spec, "meta")
    runner, mesh = build_runner(model, layout, tspec, device)

    def log(text: str) -> None:
        if rank == 0:
            print(text, file=sys.stderr, flush=True)

    batch_rank = mesh.coord("batch") if mesh is not None else 0

    parts = runner.model_parts
    # the layout's optimizer (ZeRO-1's sharded one, per-parameter steps across meshes: parallel/api.py)
    optimizers = [runner.build_optimizer(part) for part in parts]
    start = 0
    if checkpoint is not None:
        supervise.mark(0, f"loading checkpoint {checkpoint.name}")
        state = load_checkpoint(checkpoint, parts, optimizers)
        _record_config(run_dir, resolved, rank)
        start = state["step"]
        if start >= tspec.steps:
            log(f"checkpoint is at step {start}, at or past --steps {tspec.steps}: nothing to train")
        if (timeline := getattr(runner, "timeline", None)) is not None:
            timeline.resume_after(start)  # its steps numbered as metrics.jsonl numbers them

    ledger = _make_ledger(mesh)
    mfu = MfuMeter(spec, tspec.seq_len, world, device)
    metrics = MetricsLog(
        run_dir, rank, world, tspec.steps, start, progress=progress, log_every=tspec.log_every
    )
    result = TrainResult(run_dir, layout, first_step=start + 1)
    tokens_per_step = global_batch * tspec.seq_len

    def fetch(step: int) -> tuple[torch.Tensor, ...]:
        return sample_batch(data.train, tspec.seq_len, global_batch, tspec.seed, step, batch_rank, data_ranks)

    batches = BatchPrefetcher(fetch, device, tspec.steps)
    saved_beside = {"seed": tspec.seed, "model": model_record(spec)}  # each checkpoint's trainer.json
    try:
        for step in range(start + 1, tspec.steps + 1):
            lr = lr_at(step, tspec)
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = lr
            x, y = batches.get(step)  # sampled while the previous step ran
            _sync(device)
            t0 = time.perf_counter()
            acts = ActivationMeter() if _measures_memory(step, tspec) else None
            profiled = torch_profile(run_dir, rank, device.type, step == tspec.profile_step)
            with profiled, _step_ledger(ledger), acts or contextlib.nullcontext():
                supervise.mark(step, "forward_backward")
                # precision is the runner's (fivefold.parallel.precision): no autocast here
                with tracer.span("forward_backward", step=step):
                    loss = runner.forward_backward(x, y)
                supervise.mark(step, "optimizer")
                with tracer.span("optimizer", cat="optimizer", step=step):
                    grad_norm = runner.clip_grad_norm(tspec.grad_clip)
                    # the norm is global (every rank reads the same value, so all stop together): a
                    # step with non-finite gradients would write NaN into the weights and the next
                    # checkpoint, so the run stops before it, with the last step's weights intact
                    norm_value = float(grad_norm)
                    if not math.isfinite(norm_value):
                        raise FivefoldError(_diverged("gradient norm", norm_value, step, tspec, loss))
                    for opt in optimizers:
                        opt.step()
                    runner.after_optimizer_step()
            loss_value = float(loss)
            _sync(device)
            seconds = time.perf_counter() - t0
            memory = state_bytes(parts, None)  # gradients are still there until zero_grad
            memory["optimizer"] = sum(state_bytes([], opt)["optimizer"] for opt in optimizers)
            if acts is not None:
                memory["activations"] = acts.peak_bytes
            memory.update(device_memory(device))
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            if not math.isfinite(loss_value):
                raise FivefoldError(_diverged("loss", loss_value, step, tspec))
            tokens_per_s, mfu_value = mfu(tokens_per_step, seconds)
            rec: dict[str, Any] = {
                "step": step,
                "loss": loss_value,
                "tokens_per_s": tokens_per_s,
                "mfu": mfu_value,
                "grad_norm": norm_value,
                "lr": lr,
                "step_time_s": seconds,
                "memory": memory,
            }
            if step % tspec.eval_every == 0 or step == tspec.steps:
                supervise.mark(step, "held-out evaluation")
                with tracer.span("eval", cat="eval", step=step):
                    rec["held_out_loss"] = evaluate(
                        runner, data, tspec, global_batch, batch_rank, data_ranks, device
                    )
                result.held_out_loss = rec["held_out_loss"]
            metrics.record(rec)
            if not math.isfinite(rec.get("held_out_loss", 0.0)):
                raise FivefoldError(_diverged("held-out loss", rec["held_out_loss"], step, tspec))
            result.losses.append(loss_value)
            saved = None
            every = tspec.checkpoint_every
            if (step == tspec.steps and every >= 0) or (every > 0 and step % every == 0):
                _refuse_non_finite_weights(parts, step, tspec)
                supervise.mark(step, "saving a checkpoint")
                with tracer.span("checkpoint", cat="checkpoint", step=step):
                    saved = save_checkpoint(run_dir, step, parts, optimizers, saved_beside, KEEP_CHECKPOINTS)
            supervise.mark(step, "agreeing whether to stop")
            signum = _stop_signal(device)
            if signum and step < tspec.steps:
                if checkpoint_on_interrupt and saved is None:
                    supervise.mark(step, "saving a checkpoint on interrupt")
                    saved = save_checkpoint(run_dir, step, parts, optimizers, saved_beside, KEEP_CHECKPOINTS)
                raise supervise.Interrupted(signum, step, saved)
    finally:
        batches.close()
        metrics.close()
    supervise.mark(tspec.steps, "writing the run's outputs")
    _write_outputs(run_dir, rank, world, tracer, ledger, runner, spec.vocab, mfu.hardware, start + 1)
    return result


def _refuse_non_finite_weights(parts: list[nn.Module], step: int, tspec: TrainSpec) -> None:
    """Collective: a checkpoint is not saved over weights that are no longer finite numbers (an
    update too large for the dtype), so the last whole checkpoint stays the newest one."""
    # with tp or pp only one rank's shard may hold the damage: the ranks agree before any refuses
    local = next((name for part in parts if (name := first_non_finite(part.named_parameters()))), None)
    if first_problem_of_all(local) is not None:
        raise FivefoldError(
            f"the weights stopped being finite numbers at step {step}, and no checkpoint was saved "
            f"over them: {_remedy(tspec)}"
        )


def _diverged(what: str, value: float, step: int, tspec: TrainSpec, loss: torch.Tensor | None = None) -> str:
    """One line for a run whose loss or gradients stopped being finite numbers."""
    seen = f" (the loss was {float(loss):.4g})" if loss is not None else ""
    kept = f"; the step was not applied, the weights are step {step - 1}'s" if what == "gradient norm" else ""
    # step 1's own loss and gradients come before any update: the learning rate played no part yet
    untrained = step == 1 and what != "held-out loss"
    return f"the {what} became {value} at step {step}{seen}{kept}: {_remedy(tspec, untrained)}"


def _remedy(tspec: TrainSpec, untrained: bool = False) -> str:
    fp32 = " or train in fp32 (--dtype fp32)" if tspec.dtype != "fp32" else ""
    if untrained:
        return f"the initial weights give it: check the model's init_std, norm_eps and rope_theta{fp32}"
    return "lower --lr" + fp32


def _measures_memory(step: int, tspec: TrainSpec) -> bool:
    every = tspec.measure_memory_every
    return every > 0 and ((step - 1) % every == 0 or step == tspec.steps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# ledger and run-directory outputs


# steps the ledger's summary leaves out: torch's pipeline stages exchange tensor shapes in the first
# step and DDP rebuilds its buckets (two broadcasts) in the second; the per-step list keeps them
LEDGER_WARMUP_STEPS = 2


def warmup_collectives(layout: Layout, step: int) -> str:
    """Why step `step` (0-based) of a run of `layout` carries one-time collectives no steady step has
    (and no plan counts), or "" when it does not."""
    if step == 0 and layout.pp > 1:
        return "torch's pipeline stages exchange their tensor shapes in the first step"
    ddp = layout.pp == 1 and layout.tp == 1 and layout.fsdp == 1 and layout.dp * layout.cp > 1
    if step == 0 and ddp:  # DDP's first buckets: no size limit, as it builds them before any backward
        return "torch's DDP all-reduces every gradient in one bucket until it rebuilds its buckets"
    if step == 1 and ddp:
        return "torch's DDP rebuilds its gradient buckets in the second step (two broadcasts from rank 0)"
    return ""


def _make_ledger(mesh: Any) -> Any:
    if mesh is None:
        return None
    return CommLedger(mesh)


@contextlib.contextmanager
def _step_ledger(ledger: Any):
    """Record one optimizer step's collectives (forward, backward, clipping, optimizer)."""
    if ledger is None:
        yield
        return
    with ledger:
        yield
    ledger.next_step()


def _write_outputs(
    run_dir: Path,
    rank: int,
    world: int,
    tracer: Tracer,
    ledger: Any,
    runner: Any,
    vocab: int,
    hardware: str,
    first_step: int,
) -> None:
    tracer.write_part(run_dir)
    _barrier()
    if rank == 0:
        merge_trace_parts(run_dir, world)
    timeline = getattr(runner, "timeline", None)
    if timeline is not None:  # the pipeline's per-micro-batch events join the same trace
        write_trace(run_dir / "trace.json", timeline)
    if rank == 0 and ledger is not None:  # the summary is the steady step that `fivefold verify` plans
        ledger.write(run_dir / "ledger.json", skip=LEDGER_WARMUP_STEPS, first_step=first_step)
    elif rank == 0:  # one process: nothing crosses a process boundary
        empty = {"rank": 0, "steps": 0, "per_step": [], "summary": [], "by_axis": {}}
        (run_dir / "ledger.json").write_text(json.dumps(empty, indent=1))
    if rank == 0:
        plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss.png", vocab)
        # the threads each rank computed with: a CPU run's plan needs them (`fivefold plan --validate`)
        # and the torch they ran under, whose SDPA kernel on the GPU the plan of the run follows
        facts = {
            "world": world,
            "mfu_peak_from": hardware,
            "threads_per_rank": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        write_text_whole(run_dir / "run.json", json.dumps(facts, indent=1), "output")
    _barrier()
