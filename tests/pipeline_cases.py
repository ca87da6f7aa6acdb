"""Spawned-rank bodies for the pipeline tests: each layout against the single-process model.

Every rank trains its pipelined chunks and, alongside, the whole single-process model on the whole
global batch (tiny models, so this is cheap), then reports the differences: losses, gradient norms,
eval loss, updated parameters (DTensors made full), and what the ledger and the timeline saw.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

SEQ = 16
MICRO = 2  # sequences per pipeline micro-batch


def _spec(name: str, layers: int | None = None):
    from fivefold.config import load_model

    spec = load_model(name)
    return dataclasses.replace(spec, layers=layers) if layers else spec


def run_cases(
    rank: int, world: int, cases: list[dict[str, Any]], train_dir: str | None = None, **train_layout: Any
) -> list[dict[str, Any]]:
    """Every case, then (with `train_dir`) a short real training run through the loop on this world."""
    results = [run_case(rank, world, **case) for case in cases]
    if train_dir is not None:
        from fivefold.config import Layout, RunConfig, TrainSpec, load_model
        from fivefold.train.loop import train

        cfg = RunConfig(
            model=load_model("tiny"),
            layout=Layout(**train_layout),
            train=TrainSpec(
                steps=3, seq_len=32, micro_batch=4, eval_every=3, eval_batches=2, warmup_steps=1, log_every=1
            ),
        )
        train(cfg, train_dir, progress=False)
    return results


def run_case(
    rank: int,
    world: int,
    model: str = "tiny",
    layers: int | None = None,
    steps: int = 5,
    clip: float = 0.05,
    ledger: bool = False,
    **layout_kwargs: Any,
) -> dict[str, Any]:
    from fivefold.config import Layout, TrainSpec
    from fivefold.measure.memory import ActivationMeter
    from fivefold.measure.timeline import COMPUTE_KINDS, idle_fraction
    from fivefold.model import build_model, materialize
    from fivefold.parallel.api import LocalRunner
    from fivefold.parallel.data import make_optimizer
    from fivefold.parallel.device_mesh import build_runtime_mesh
    from fivefold.parallel.runners import build_runner

    spec = _spec(model, layers)
    layout = Layout(**layout_kwargs).resolve(world)
    m = layout.microbatches
    train = TrainSpec(seq_len=SEQ, micro_batch=m * MICRO, seed=7, lr=1e-2)
    mesh = build_runtime_mesh(layout, "cpu")
    runner = build_runner(build_model(spec), mesh, layout, train)
    reference = materialize(build_model(spec), "cpu", train.seed)
    local = LocalRunner(reference, MICRO)
    dp = layout.data_parallel
    share = mesh.coord("batch")
    # the optimizers the loop builds: AdamW with decay on matrices, ZeRO-1 over plain dp with --zero 1
    optimizers = [runner.build_optimizer(part) for part in runner.model_parts]
    ref_opt = make_optimizer(reference, train, Layout().resolve(1), None)
    gen = torch.Generator().manual_seed(123)
    out: dict[str, Any] = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": [], "split": runner.split}
    book = None
    if ledger:
        from fivefold.measure.ledger import CommLedger

        book = CommLedger(mesh)
    local_batch = m * MICRO
    for step in range(steps):
        x = torch.randint(0, spec.vocab, (dp * local_batch, SEQ), generator=gen)
        y = torch.randint(0, spec.vocab, (dp * local_batch, SEQ), generator=gen)
        mine = slice(share * local_batch, (share + 1) * local_batch)
        with ActivationMeter() as meter:
            if book is not None and step > 0:  # step 0 also exchanges the stages' shapes
                with book:
                    loss = runner.forward_backward(x[mine], y[mine])
                book.next_step()
            else:
                loss = runner.forward_backward(x[mine], y[mine])
        out["activation_peak"] = max(out.get("activation_peak", 0), meter.peak_bytes)
        out["loss"].append(loss.item())
        out["ref_loss"].append(local.forward_backward(x, y).item())
        out["norm"].append(runner.clip_grad_norm(clip).item())
        out["ref_norm"].append(local.clip_grad_norm(clip).item())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    ex = torch.randint(0, spec.vocab, (dp * local_batch, SEQ), generator=gen)
    ey = torch.randint(0, spec.vocab, (dp * local_batch, SEQ), generator=gen)
    mine = slice(share * local_batch, (share + 1) * local_batch)
    out["eval"] = runner.eval_loss(ex[mine], ey[mine]).item()
    out["ref_eval"] = local.eval_loss(ex, ey).item()
    ref_params = dict(reference.named_parameters())
    worst, names = 0.0, []
    for part in runner.model_parts:
        for name, p in part.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            worst = max(worst, (full.detach() - ref_params[name].detach()).abs().max().item())
            names.append(name)
    out["param_err"], out["names"] = worst, names
    out["stages"], out["pp_rank"] = runner.stage_ids, mesh.coord("pp")
    if book is not None:
        rows = book.summary()
        out["p2p"] = {
            r["op"]: (r["count"], r["bytes"])
            for r in rows
            if r["axis"] == "pp" and r["op"] in ("send", "recv")
        }
    events = runner.timeline.events()
    last = max(e["args"]["step"] for e in events)
    out["kinds"] = sorted(
        {
            (e["args"]["stage"], e["args"]["kind"], e["args"]["mb"])
            for e in events
            if e["args"]["step"] == last and e["args"]["kind"] in COMPUTE_KINDS
        }
    )
    out["comm_events"] = sum(1 for e in events if e["args"]["kind"] in ("send", "recv", "send/recv"))
    from fivefold.measure.timeline import gather_events

    everything = gather_events(runner.timeline)
    out["measured_idle"] = idle_fraction(everything) if everything is not None else None
    return out
