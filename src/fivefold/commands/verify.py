"""`fivefold verify`: run a layout and the single-process reference on the same weights and data.

    fivefold verify --model tiny --nproc 4 --fsdp 2 --tp 2 --sp --steps 5

Both train `--steps` AdamW steps from the same seeded weights on the same random-token batches
(each rank takes its data-parallel share); the table shows each step's loss on both sides, then
the largest difference of the updated parameters (gathered from their shards) and the measured
communication of one step per axis beside what `fivefold plan` predicts for it (shown, not judged:
the planner counts activations in 16 bits). PASS when losses agree within 1e-5 relative and
parameters within 1e-5 absolute (fp32, lr 1e-3, AdamW eps 1e-6 — see docs/parallel.md); exit 1
on FAIL.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from fivefold.config import Layout, TrainSpec, add_layout_arguments, layout_from_args, load_model
from fivefold.errors import FivefoldError

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="model preset or file (default tiny)")
    parser.add_argument("--nproc", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per forward")
    parser.add_argument(
        "--accumulation",
        type=int,
        default=0,
        help="micro-batches per data-parallel rank (default 1, or --microbatches with --pp)",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--grad-clip", type=float, default=0.3, help="global-norm clip (0: off)")
    parser.add_argument(
        "--ledger-step", type=int, default=-1, help="step whose communication is shown (default: the last)"
    )
    add_layout_arguments(parser)


def run(args: argparse.Namespace) -> int:
    spec = load_model(args.model)
    if args.nproc < 2 or args.nproc > 64:
        raise FivefoldError(f"--nproc must be in 2..64 for a multi-rank comparison, got {args.nproc}")
    if args.steps < 1:
        raise FivefoldError(f"--steps must be positive, got {args.steps}")
    base = layout_from_args(args)
    if all(getattr(base, a) == 1 for a in ("dp", "fsdp", "tp", "pp", "cp")):
        base = dataclasses.replace(base, dp=args.nproc)
    layout = base.resolve(args.nproc)
    train = TrainSpec(
        seed=args.seed,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        lr=args.lr,
        eps=1e-6,
        grad_clip=args.grad_clip,
        steps=args.steps,
    ).validate()
    layout.check_model(spec, train.seq_len)
    from fivefold.train.loop import check_runtime_axes

    check_runtime_axes(layout)
    accumulation = args.accumulation or (layout.microbatches if layout.pp > 1 else 1)
    rows = train.micro_batch * layout.dp * layout.fsdp * accumulation
    train = dataclasses.replace(train, global_batch=rows)
    ledger_step = args.ledger_step if args.ledger_step >= 0 else args.steps - 1

    from fivefold.parallel.compare import RunResult, compare, run_reference
    from fivefold.parallel.spawn import spawn_ranks

    per_rank = spawn_ranks(_rank_body, args.nproc, spec, train, layout, rows, args.steps, ledger_step)
    params: dict[str, Any] = {}
    for r in per_rank:  # pipeline stages each bring their own layers
        params.update(r["params"])
    ours = RunResult(per_rank[0]["losses"], per_rank[0]["grad_norms"], params)
    reference = run_reference(spec, train, rows, args.steps)
    missing = sorted(set(reference.params) - set(params))
    if missing:
        raise FivefoldError(
            f"the layout run returned no values for {len(missing)} parameters, e.g. {missing[0]}"
        )
    result = compare(reference, ours, LOSS_RTOL, PARAM_ATOL)
    same_everywhere = all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
    _print_report(
        spec.name,
        layout,
        args.nproc,
        reference,
        ours,
        result,
        per_rank[0]["ledger"],
        ledger_step,
        same_everywhere,
        _planned_bytes(spec, layout, train, rows),
    )
    ok = result.ok and same_everywhere
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _rank_body(
    rank: int, world: int, spec, train: TrainSpec, layout: Layout, rows: int, steps: int, ledger_step: int
) -> dict:
    from fivefold.parallel.compare import ledger_step_hook, run_layout
    from fivefold.parallel.device_mesh import build_runtime_mesh
    from fivefold.parallel.ledger import CommLedger

    mesh = build_runtime_mesh(layout)
    ledger = CommLedger(mesh)

    hook = ledger_step_hook(ledger, ledger_step, split_optimizer=False)
    result, _, _ = run_layout(spec, train, layout, rows, steps, mesh, hook)
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "params": result.params,
        "ledger": ledger.summary(),
    }


def _planned_bytes(spec, layout: Layout, train: TrainSpec, rows: int) -> dict[tuple[str, str], float]:
    """What `fivefold plan` predicts per step, by (axis, op), for fp32 weights and gradients."""
    from fivefold.config import load_hardware
    from fivefold.plan import TrainShape, plan

    try:
        shape = TrainShape(
            seq_len=train.seq_len,
            global_batch=rows,
            micro_batch=train.micro_batch,
            param_bytes=4,
            grad_bytes=4,
            optimizer_bytes=8,
        )
        predicted = plan(spec, load_hardware("cpu"), layout, shape, gpus_per_node=layout.world)
    except FivefoldError:
        return {}
    return {(c.axis, c.op.replace("-", "_")): c.bytes for c in predicted.comm}


def _print_report(
    model: str,
    layout: Layout,
    nproc: int,
    reference,
    ours,
    result,
    ledger: list[dict],
    ledger_step: int,
    same_everywhere: bool,
    planned: dict[tuple[str, str], float],
) -> None:
    split = [a for a in ("dp", "fsdp", "tp", "pp", "cp") if getattr(layout, a) > 1]
    axes = " × ".join(f"{a}{getattr(layout, a)}" for a in split)
    extras = [f"zero {layout.zero}"] + (["sp"] if layout.sp else [])
    print(f"verify {model} on {nproc} ranks: {axes or 'one replica'} ({', '.join(extras)})")
    print(f"{'step':>4}  {'reference loss':>15}  {'layout loss':>15}  {'rel diff':>9}")
    for i, (a, b, rel) in enumerate(zip(reference.losses, ours.losses, result.loss_rel)):
        print(f"{i:>4}  {a:>15.8f}  {b:>15.8f}  {rel:>9.2e}")
    print(
        f"updated parameters: max abs diff {result.max_abs:.3e} ({result.worst_param}), "
        f"max rel diff {result.max_rel:.3e}; tolerances: loss {LOSS_RTOL:g} rel, params {PARAM_ATOL:g} abs"
    )
    if not same_everywhere:
        print("the reported loss differs between ranks")
    print(f"communication of step {ledger_step} on rank 0: measured (ledger) and predicted (fivefold plan)")
    print(f"  {'axis':<10} {'op':<15} {'count':>6} {'bytes':>12} {'plan bytes':>12}")
    for row in ledger:
        plan_bytes = planned.get((row["axis"], row["op"]))
        shown = f"{plan_bytes:>12,.0f}" if plan_bytes is not None else f"{'-':>12}"
        print(f"  {row['axis']:<10} {row['op']:<15} {row['count']:>6.0f} {row['bytes']:>12,.0f} {shown}")
