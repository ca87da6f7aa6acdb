"""The training loop: one code path for every layout.

The loop owns data, optimizer, learning-rate schedule, metrics and checkpoints; a `StepRunner`
owns how this rank's share of a batch becomes gradients (`fivefold.parallel.api`). One process
uses the single-device `LocalRunner`; several ranks use the runner that
`fivefold.parallel.apply.build_runner` builds for the layout. Nothing here looks at which axes
are split, except to pick this rank's share of the batch (its `batch` coordinate).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fivefold.config import AXES, Layout, ModelSpec, RunConfig, TrainSpec
from fivefold.errors import FivefoldError
from fivefold.model import build_model, materialize
from fivefold.model.moe import moe_layers
from fivefold.parallel import apply
from fivefold.parallel.api import LocalRunner
from fivefold.parallel.device_mesh import build_runtime_mesh
from fivefold.parallel.ledger import CommLedger
from fivefold.parallel.recompute import apply_recompute
from fivefold.parallel.timeline import write_trace
from fivefold.support import check_trainable
from fivefold.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from fivefold.train.data import EVAL_STREAM, TokenData, load_data, sample_batch
from fivefold.train.memory import ActivationMeter, device_memory, state_bytes
from fivefold.train.metrics import MetricsLog, MfuMeter
from fivefold.train.plots import plot_loss_curve
from fivefold.train.tokenizer import load_tokenizer
from fivefold.train.trace import Tracer, merge_trace_parts

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


def default_layout(layout: Layout, world: int) -> Layout:
    """Several ranks and no axis set: plain data parallelism over all of them."""
    if world > 1 and all(getattr(layout, a) == 1 for a in AXES):
        return replace(layout, dp=world)
    return layout


def runtime_layout(layout: Layout, world: int, model: ModelSpec, seq_len: int) -> Layout:
    """The layout a training run uses: defaults filled, resolved, and checked (`check_trainable`, the
    planner's check too) before any rank starts."""
    lay = default_layout(layout, world).resolve(world)
    check_trainable(model, lay, seq_len)
    return lay


def make_optimizer(module: torch.nn.Module, train: TrainSpec) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (norm weights and biases are left alone)."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=train.eps,
        foreach=True,
    )


def _broadcast(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
        apply_recompute(model, layout.recompute)
        return LocalRunner(model, train.micro_batch), None
    mesh = build_runtime_mesh(layout, device.type)
    return apply.build_runner(model, mesh, layout, train), mesh


def _setup_run_dir(run_dir: Path, cfg: RunConfig, resume: str | None, rank: int) -> None:
    has_run = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()
    if has_run and resume is None:
        raise FivefoldError(
            f"{run_dir} already holds a run; pass --resume to continue it or pick another --run-dir"
        )
    if rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(cfg.to_toml())
        except OSError as exc:
            raise FivefoldError(f"cannot write the run directory {run_dir}: {exc}") from None


def evaluate(
    runner: Any,
    data: TokenData,
    train: TrainSpec,
    global_batch: int,
    rank: int,
    ranks: int,
    device: torch.device,
    autocast: Any,
) -> float:
    """Mean loss over `eval_batches` fixed held-out batches (the same ones at every evaluation)."""
    losses = []
    for i in range(train.eval_batches):
        x, y = sample_batch(
            data.held_out, train.seq_len, global_batch, train.seed, i, rank, ranks, EVAL_STREAM
        )
        with autocast():
            losses.append(float(runner.eval_loss(x.to(device), y.to(device))))
    return sum(losses) / len(losses)


def train(
    cfg: RunConfig, run_dir: str | Path, resume: str | None = None, progress: bool = True
) -> TrainResult:
    """Train `cfg` in this process (one rank of a launched world, or alone) and fill `run_dir`."""
    spec, train_spec = cfg.model.validate(), cfg.train.validate()
    device = resolve_device(train_spec)
    created_group = init_distributed(device)
    try:
        return _train(cfg, spec, train_spec, Path(run_dir), resume, device, progress)
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(
    cfg: RunConfig,
    spec: Any,
    tspec: TrainSpec,
    run_dir: Path,
    resume: str | None,
    device: torch.device,
    progress: bool,
) -> TrainResult:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = runtime_layout(cfg.layout, world, spec, tspec.seq_len)
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
    data = load_data(tspec.data, tokenizer, tspec.seq_len)  # bad data fails before anything is written
    if data.max_token >= spec.vocab:
        raise FivefoldError(
            f"data {tspec.data} holds token id {data.max_token}, outside the model's vocab {spec.vocab}"
        )
    run_dir = Path(_broadcast(str(run_dir)))
    checkpoint = find_checkpoint(run_dir, resume) if resume is not None else None
    resolved = RunConfig(model=spec, train=tspec, layout=layout)
    _setup_run_dir(run_dir, resolved, resume, rank)
    _barrier()

    torch.manual_seed(tspec.seed)
    tracer = Tracer(rank)
    model = build_model(spec, "meta")
    runner, mesh = build_runner(model, layout, tspec, device)

    def log(text: str) -> None:
        if rank == 0:
            print(text, file=sys.stderr, flush=True)

    batch_rank = mesh.coord("batch") if mesh is not None else 0

    parts = runner.model_parts
    # a layout may build its own (ZeRO-1's sharded optimizer; see StepRunner in parallel/api.py)
    build = getattr(runner, "build_optimizer", None) or (lambda part: make_optimizer(part, tspec))
    optimizers = [build(part) for part in parts]
    start = 0
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, parts, optimizers)
        start = state["step"]
        if start >= tspec.steps:
            log(f"checkpoint is at step {start}, at or past --steps {tspec.steps}: nothing to train")

    use_autocast = tspec.dtype == "bf16" and layout.fsdp == 1  # FSDP runs carry their own policy

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=torch.bfloat16) if use_autocast else contextlib.nullcontext()

    ledger = _make_ledger(mesh)
    mfu = MfuMeter(spec, tspec.seq_len, world, device)
    metrics = MetricsLog(
        run_dir, rank, world, tspec.steps, start, progress=progress, log_every=tspec.log_every
    )
    result = TrainResult(run_dir, layout, first_step=start + 1)
    tokens_per_step = global_batch * tspec.seq_len
    try:
        for step in range(start + 1, tspec.steps + 1):
            lr = lr_at(step, tspec)
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = lr
            x, y = sample_batch(
                data.train, tspec.seq_len, global_batch, tspec.seed, step, batch_rank, data_ranks
            )
            x, y = x.to(device), y.to(device)
            _sync(device)
            t0 = time.perf_counter()
            acts = ActivationMeter() if _measures_memory(step, tspec) else None
            with _step_ledger(ledger), acts or contextlib.nullcontext():
                with tracer.span("forward_backward", step=step), autocast():
                    loss = runner.forward_backward(x, y)
                with tracer.span("optimizer", cat="optimizer", step=step):
                    grad_norm = runner.clip_grad_norm(tspec.grad_clip)
                    for opt in optimizers:
                        opt.step()
                    _after_step(runner, parts)
            loss_value, norm_value = float(loss), float(grad_norm)
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
                raise FivefoldError(f"the loss became {loss_value} at step {step}; lower --lr or use fp32")
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
                with tracer.span("eval", cat="eval", step=step):
                    rec["held_out_loss"] = evaluate(
                        runner, data, tspec, global_batch, batch_rank, data_ranks, device, autocast
                    )
                result.held_out_loss = rec["held_out_loss"]
            metrics.record(rec)
            result.losses.append(loss_value)
            if step == tspec.steps or (tspec.checkpoint_every and step % tspec.checkpoint_every == 0):
                with tracer.span("checkpoint", cat="checkpoint", step=step):
                    save_checkpoint(run_dir, step, parts, optimizers, {"seed": tspec.seed}, KEEP_CHECKPOINTS)
    finally:
        metrics.close()
    _write_outputs(run_dir, rank, world, tracer, ledger, runner, spec.vocab, mfu.hardware)
    return result


def _measures_memory(step: int, tspec: TrainSpec) -> bool:
    every = tspec.measure_memory_every
    return every > 0 and ((step - 1) % every == 0 or step == tspec.steps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _after_step(runner: Any, parts: list[torch.nn.Module]) -> None:
    """Per-step updates outside the optimizer: the runner's own, or the MoE balancing bias."""
    hook = getattr(runner, "after_optimizer_step", None)
    if hook is not None:
        hook()
        return
    for part in parts:
        for moe in moe_layers(part):
            moe.update_bias()


# --------------------------------------------------------------------------------------------
# ledger and run-directory outputs


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
    run_dir: Path, rank: int, world: int, tracer: Tracer, ledger: Any, runner: Any, vocab: int, hardware: str
) -> None:
    tracer.write_part(run_dir)
    _barrier()
    if rank == 0:
        merge_trace_parts(run_dir, world)
    timeline = getattr(runner, "timeline", None)
    if timeline is not None:  # the pipeline's per-micro-batch events join the same trace
        write_trace(run_dir / "trace.json", timeline)
    if rank == 0 and ledger is not None:
        ledger.write(run_dir / "ledger.json")
    elif rank == 0:  # one process: nothing crosses a process boundary
        empty = {"rank": 0, "steps": 0, "per_step": [], "summary": [], "by_axis": {}}
        (run_dir / "ledger.json").write_text(json.dumps(empty, indent=1))
    if rank == 0:
        plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss.png", vocab)
        (run_dir / "run.json").write_text(json.dumps({"world": world, "mfu_peak_from": hardware}, indent=1))
    _barrier()
