"""Train a layout and the single-process model on the same weights and data, and compare.

Both sides see the same global batches (random tokens drawn from (seed, step)); each rank of the
layout takes the rows of its `batch` coordinate, as the training loop does. Both use AdamW with
the same groups and the same global-norm clipping, so after K steps the losses and the updated
parameters must agree to floating-point reordering. Used by `fivefold verify` and the tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fivefold.config import Layout, ModelSpec, TrainSpec
from fivefold.model.transformer import build_model, materialize
from fivefold.parallel.api import LocalRunner
from fivefold.parallel.data import make_optimizer


@dataclass
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # full (gathered) tensors
    eval_loss: float | None = None  # on the batch after the last step, when asked for
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # the weights before the first step


def global_batch(spec: ModelSpec, train: TrainSpec, rows: int, step: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(train.seed * 100_003 + step)
    tokens = torch.randint(0, spec.vocab, (rows, train.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def rows_of(batch: torch.Tensor, coord: int, ranks: int) -> torch.Tensor:
    """This data rank's rows, a tensor of their own as train's sampler hands them (a view would keep
    the whole global batch alive wherever autograd saves a micro-batch's ids or targets)."""
    per = batch.shape[0] // ranks
    return batch[coord * per : (coord + 1) * per].contiguous()


def run_reference(
    spec: ModelSpec, train: TrainSpec, rows: int, steps: int, evaluate: bool = False
) -> RunResult:
    """The single-process model: LocalRunner, AdamW, clipping, `steps` steps on the global batches
    (with `evaluate`, then the eval loss on the next global batch)."""
    model = materialize(build_model(spec, "meta"), "cpu", train.seed)
    runner = LocalRunner(model, train.micro_batch)
    opt = make_optimizer(model, train, Layout(), None)
    result = RunResult([], [])
    result.initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(steps):
        x, y = global_batch(spec, train, rows, step)
        opt.zero_grad(set_to_none=True)
        result.losses.append(float(runner.forward_backward(x, y)))
        result.grad_norms.append(float(runner.clip_grad_norm(train.grad_clip)))
        opt.step()
    if evaluate:
        result.eval_loss = float(runner.eval_loss(*global_batch(spec, train, rows, steps)))
    result.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return result


def run_layout(
    spec: ModelSpec,
    train: TrainSpec,
    layout: Layout,
    rows: int,
    steps: int,
    runtime_mesh: Any,
    step_hook: Any = None,
) -> tuple[RunResult, Any, torch.optim.Optimizer]:
    """This rank's side of the same run under `layout` (already resolved).

    Returns (result, runner, optimizer of the first model part); `step_hook(step, phase)` is called
    at "begin", "backward" (after forward_backward) and "end" (after the optimizer step) of each step.
    """
    runner, optimizers = build_layout(spec, train, layout, runtime_mesh)
    result = train_steps(spec, train, rows, steps, runtime_mesh, runner, optimizers, step_hook)
    return result, runner, optimizers[0]


def build_layout(
    spec: ModelSpec, train: TrainSpec, layout: Layout, runtime_mesh: Any
) -> tuple[Any, list[torch.optim.Optimizer]]:
    """The runner of `layout` and one optimizer per local model part (pipeline chunks have several)."""
    from fivefold.parallel.runners import build_runner

    runner = build_runner(build_model(spec, "meta"), runtime_mesh, layout, train)
    return runner, [runner.build_optimizer(part) for part in runner.model_parts]


def train_steps(
    spec: ModelSpec,
    train: TrainSpec,
    rows: int,
    steps: int,
    runtime_mesh: Any,
    runner: Any,
    optimizers: list[torch.optim.Optimizer],
    step_hook: Any = None,
    evaluate: bool = False,
) -> RunResult:
    """`steps` steps of `runner` on this rank's rows of the global batches (with `evaluate`, then
    the eval loss on the next global batch); the parameters come back gathered."""
    coord, ranks = runtime_mesh.coord("batch"), runtime_mesh.size("batch")
    result = RunResult([], [])
    for step in range(steps):
        x, y = global_batch(spec, train, rows, step)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if step_hook is not None:
            step_hook(step, "begin")
        loss = runner.forward_backward(rows_of(x, coord, ranks), rows_of(y, coord, ranks))
        result.losses.append(float(loss))
        if step_hook is not None:
            step_hook(step, "backward")
        result.grad_norms.append(float(runner.clip_grad_norm(train.grad_clip)))
        for opt in optimizers:
            opt.step()
        if step_hook is not None:
            step_hook(step, "end")
    if evaluate:
        x, y = global_batch(spec, train, rows, steps)
        result.eval_loss = float(runner.eval_loss(rows_of(x, coord, ranks), rows_of(y, coord, ranks)))
    for part in runner.model_parts:
        result.params.update(gather_params(part))
    return result


def gather_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as the full tensor (DTensor shards gathered)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = t.full_tensor() if isinstance(t, DTensor) else t.clone()
    return out


@dataclass
class Comparison:
    loss_rel: list[float]
    max_abs: float
    max_rel: float
    worst_param: str
    ok: bool


def compare(
    reference: RunResult, other: RunResult, loss_rtol: float = 1e-5, param_atol: float = 5e-5
) -> Comparison:
    loss_rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference.losses, other.losses)]
    max_abs, max_rel, worst = 0.0, 0.0, ""
    for name, ref in reference.params.items():
        got = other.params[name].to(ref.device, ref.dtype)
        diff = (got - ref).abs().max().item()
        rel = diff / max(ref.abs().max().item(), 1e-12)
        if diff > max_abs:
            max_abs, worst = diff, name
        max_rel = max(max_rel, rel)
    ok = len(other.losses) == len(reference.losses) and max(loss_rel) <= loss_rtol and max_abs <= param_atol
    return Comparison(loss_rel, max_abs, max_rel, worst, ok)


def with_accumulation(train: TrainSpec, accumulation: int, data_ranks: int) -> tuple[TrainSpec, int]:
    """(train spec, global rows) for `accumulation` micro-batches per data-parallel rank."""
    rows = train.micro_batch * data_ranks * accumulation
    return dataclasses.replace(train, global_batch=rows), rows


def measure_layout(
    spec: ModelSpec,
    train: TrainSpec,
    layout: Layout,
    rows: int,
    steps: int,
    runtime_mesh: Any,
    ledger_step: int,
) -> dict[str, Any]:
    """This rank's run of `layout` with step `ledger_step` measured: every collective of the whole
    step (forward, backward, clipping, optimizer) in the comm ledger, the peak of saved-activation
    bytes of its forward + backward, the state bytes held after it, and the rows its experts got.
    """
    from fivefold.measure.ledger import CommLedger
    from fivefold.measure.memory import ActivationMeter, device_memory, state_bytes

    runner, optimizers = build_layout(spec, train, layout, runtime_mesh)
    ledger = CommLedger(runtime_mesh)
    meter = ActivationMeter()
    routed = {"before": 0, "after": 0, "once_before": 0, "once_after": 0}
    logs: dict[int, Any] = {}  # layer -> its experts, logging the rows of each forward
    per_forward: dict[int, list[int]] = {}

    def hook(at: int, phase: str) -> None:
        if at != ledger_step:
            return
        if phase == "begin":
            routed["before"], routed["once_before"] = rows_received(runner), rows_received(runner, once=True)
            logs.update(start_rows_logs(runner))
            ledger.__enter__()
            meter.__enter__()
        elif phase == "backward":
            meter.__exit__(None, None, None)
            routed["after"], routed["once_after"] = rows_received(runner), rows_received(runner, once=True)
            for layer, experts in logs.items():
                per_forward[layer], experts.rows_log = experts.rows_log, None
        else:
            ledger.__exit__(None, None, None)

    result = train_steps(spec, train, rows, steps, runtime_mesh, runner, optimizers, hook)
    ledger.close()
    measured = ledger.per_step()
    device = next(p for part in runner.model_parts for p in part.parameters()).device
    state = {"params": 0, "grads": 0, "optimizer": 0}
    for part, opt in zip(runner.model_parts, optimizers):
        for key, value in state_bytes([part], opt).items():
            state[key] += value
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "params": result.params,
        "ledger": measured[0] if measured else [],
        "state": state,
        "activations": meter.peak_bytes,
        "process_peak": max(device_memory(device).values()),
        "rows_received": routed["after"] - routed["before"],
        "rows_received_once": routed["once_after"] - routed["once_before"],
        "rows_per_forward": per_forward,
    }


def start_rows_logs(runner: Any) -> dict[int, Any]:
    """Start logging the rows each expert-parallel MoE layer receives, forward by forward, on the
    blocks that keep their activations (a recomputed block's saved tensors do not depend on its
    routing, and its forwards run twice): {layer: its experts}. The forwards of a chunk run in
    micro-batch order under every schedule, so the log's i-th entry is micro-batch i's."""
    if runner is None:
        return {}
    from fivefold.model.moe import moe_layers
    from fivefold.parallel.recompute import is_recomputed

    out = {}
    for part in runner.model_parts:
        for key, block in getattr(part, "model", part).layers.items():
            for moe in moe_layers(block):
                if hasattr(moe.experts, "rows_log") and not is_recomputed(block):
                    moe.experts.rows_log = []
                    out[int(key)] = moe.experts
    return out


def rows_received(runner: Any, once: bool = False) -> int:
    """Rows the expert-parallel dispatch has handed this rank's experts so far; `once`: counting the
    forward that full recompute repeats in the backward once (it routes the same rows again)."""
    if runner is None:
        return 0
    from fivefold.model.moe import moe_layers
    from fivefold.parallel.recompute import blocks, is_recomputed

    total = 0
    for part in runner.model_parts:
        for block in blocks(part):
            rows = sum(getattr(moe.experts, "rows_received", 0) for moe in moe_layers(block))
            total += rows // 2 if once and is_recomputed(block) else rows
    return total
