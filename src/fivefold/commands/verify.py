"""`fivefold verify`: run a layout, judge it against the single process and against its plan.

    fivefold verify --model tiny --nproc 4 --fsdp 2 --tp 2 --sp --steps 5 [--json]

Both the layout and the single-process reference train `--steps` AdamW steps from the same seeded
weights on the same random-token batches (each rank takes its data-parallel share). One step
(`--ledger-step`, default the last) is measured on every rank: every collective in the comm ledger,
the saved-activation bytes of its forward + backward, the state bytes held. Three judgments, one
table, a PASS/FAIL per row:

  1. numerics: losses within 1e-5 relative, updated parameters within 1e-5 absolute of the single
     process (fp32; bf16 runs, coarsely: losses within 2e-2, parameters within 2·lr·steps), and
     the whole update's direction: cosine to the single process's >= 0.999 (fp32), 0.95 (bf16);
  2. communication: for every (axis, op) of the step, on every rank, measured calls and bytes equal
     the planner's (`fivefold.plan.step`) exactly; expert all-to-alls are planned from the rows
     the run actually routed to each rank (the imbalance max/mean is reported);
  3. memory per rank: parameters, gradients and optimizer state equal the plan exactly; saved
     activations within 1 % (ACTIVATION_RTOL; equal to the byte on every layout tried); the
     process's peak memory is shown.

Exit 0 when every row passes; exit 1 naming the first row that failed. DDP all-reduces every
gradient in one bucket in step 0 and rebuilds its buckets (two small broadcasts) in step 1: measure
step 2 or later for layouts that use it (the default, the last of 5, is).

Serving layouts are judged the same way by `fivefold generate --nproc N ... --verify` (`judge_serving`):
tokens against one process, each rank's collectives and KV cache against the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fivefold.config import (
    DTYPES,
    Layout,
    ModelSpec,
    TrainSpec,
    add_layout_arguments,
    check_buildable,
    check_seq_len,
    layout_from_args,
    load_model,
    say_idle_flags,
)
from fivefold.errors import FivefoldError

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
BF16_LOSS_RTOL = 2e-2
# the weights' total update must point where the single process's does (cosine of the two): in bf16
# the per-weight bound above cannot tell a run that never stepped from a healthy one (AdamW moves a
# weight by at most about lr), the direction can (UPDATE_COSINE for fp32: equal to rounding)
BF16_UPDATE_COSINE = 0.95
UPDATE_COSINE = 0.999
# saved activations are planned to the byte (`fivefold.plan.activations`, with expert parallelism
# from the rows each micro-batch's routing sent each rank, as measured); the margin is for a torch
# whose ops save slightly differently
ACTIVATION_RTOL = 0.01
# a verification is a few steps judged against a single process that runs every micro-batch too
MAX_ACCUMULATION = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="model preset or file (default tiny)")
    parser.add_argument("--nproc", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per forward")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES, help="compute dtype (default fp32)")
    parser.add_argument(
        "--accumulation",
        type=int,
        default=0,
        help="micro-batches per data-parallel rank (default 1, or --microbatches with --pp)",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--grad-clip", type=float, default=0.3, help="global-norm clip (0: off)")
    parser.add_argument(
        "--ledger-step",
        type=int,
        default=None,
        help="step that is measured, 1 to --steps as train numbers them (default: the last past warm-up)",
    )
    parser.add_argument("--json", action="store_true", help="print the judgment as JSON")
    add_layout_arguments(parser)


@dataclass
class Row:
    """One judged line of the table."""

    judgment: str  # numerics | comm | memory
    name: str
    measured: str
    planned: str
    diff: float  # relative difference (0 when equal)
    ok: bool | None  # None: shown, not judged

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def run(args: argparse.Namespace) -> int:
    spec = load_model(args.model)
    check_buildable(spec)
    from fivefold.parallel.spawn import MAX_LOCAL_RANKS

    if args.nproc < 2 or args.nproc > MAX_LOCAL_RANKS:
        raise FivefoldError(
            f"--nproc must be in 2..{MAX_LOCAL_RANKS} for a multi-rank comparison, got {args.nproc}"
        )
    if args.steps < 1:
        raise FivefoldError(f"--steps must be positive, got {args.steps}")
    base = layout_from_args(args)
    base.check_experts(spec)
    layout = base.resolve(args.nproc)
    say_idle_flags(args, layout)  # resolved: dp filled, so an idle --zero is known
    train = TrainSpec(
        seed=args.seed,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        lr=args.lr,
        eps=1e-6,
        grad_clip=args.grad_clip,
        steps=args.steps,
        dtype=args.dtype,
    ).validate()
    check_seq_len(spec, train.seq_len)
    if not 0 <= args.accumulation <= MAX_ACCUMULATION:
        raise FivefoldError(
            f"--accumulation must be 1..{MAX_ACCUMULATION} (or 0: the default), got {args.accumulation}: "
            "every micro-batch runs in the ranks and again in the single-process reference"
        )
    from fivefold.support import check_trainable

    check_trainable(spec, layout, train.seq_len)  # the planner's check: refused before any rank starts
    accumulation = args.accumulation or (layout.microbatches if layout.pp > 1 else 1)
    rows = train.micro_batch * layout.dp * layout.fsdp * accumulation
    train = dataclasses.replace(train, global_batch=rows)
    if layout.pp > 1:  # the batch against --microbatches, before any rank starts (as train checks it)
        from fivefold.parallel.pipeline import check_pipeline_batch

        check_pipeline_batch(layout, train)
    from fivefold.train.loop import check_batch_fits, check_model_state_fits

    check_model_state_fits(spec, train, args.nproc)  # out of memory in the ranks is no message
    check_batch_fits(spec, train, layout, args.nproc)
    # steps are numbered from 1 here as train numbers them; inside, `ledger_step` counts from 0
    if args.ledger_step is not None and not 1 <= args.ledger_step <= args.steps:
        raise FivefoldError(
            f"--ledger-step must be a step from 1 to --steps {args.steps}, got {args.ledger_step}"
        )
    from fivefold.train.loop import LEDGER_WARMUP_STEPS, warmup_collectives

    # the last step past torch's one-time collectives (a two-step DDP run: its first), else the last
    steady = [s for s in range(args.steps) if not warmup_collectives(layout, s)]
    chosen = args.ledger_step is not None
    ledger_step = args.ledger_step - 1 if chosen else (steady or [args.steps - 1])[-1]
    warmup = warmup_collectives(layout, ledger_step)

    from fivefold.parallel.compare import run_reference
    from fivefold.parallel.spawn import spawn_ranks

    per_rank = spawn_ranks(_rank_body, args.nproc, spec, train, layout, rows, args.steps, ledger_step)
    reference = run_reference(spec, train, rows, args.steps)
    table = judge(spec, layout, train, accumulation, per_rank, reference, warmup=warmup)
    failed = next((r for r in table if r.ok is False), None)
    if args.json:
        print(json.dumps({"ok": failed is None, "rows": [r.to_json() for r in table]}, indent=1))
    else:
        _print_table(spec.name, layout, args.nproc, train, ledger_step, table)
        if warmup:
            later = [s for s in steady if s > ledger_step]
            how = (  # a measured step the user chose, with a later one to choose; else more steps
                f"measure step {later[-1] + 1} (--ledger-step {later[-1] + 1}, or leave it to the default: "
                "the last)"
                if chosen and later
                else f"run --steps {LEDGER_WARMUP_STEPS + 1} or more"
            )
            print(
                f"note: the step's collectives and saved activations are shown, not judged: {warmup}; "
                f"{how} to judge them"
            )
        print("PASS" if failed is None else f"FAIL: {failed.judgment} {failed.name}")
    return 0 if failed is None else 1


def _rank_body(
    rank: int, world: int, spec, train: TrainSpec, layout: Layout, rows: int, steps: int, ledger_step: int
) -> dict:
    from fivefold.parallel.compare import measure_layout
    from fivefold.parallel.device_mesh import build_runtime_mesh

    mesh = build_runtime_mesh(layout)
    out = measure_layout(spec, train, layout, rows, steps, mesh, ledger_step)
    out["coords"] = placement(mesh)
    return out


def placement(mesh: Any) -> dict[str, int]:
    """This rank's coordinate on every axis the planner places a rank by."""
    return {a: mesh.coord(a) for a in ("dp", "fsdp", "cp", "tp", "pp", "ep", "fsdp_cp", "batch")}


Planner = Callable[..., Any]


def judge(
    spec: ModelSpec,
    layout: Layout,
    train: TrainSpec,
    accumulation: int,
    per_rank: list[dict],
    reference: Any | None,
    planner: Planner | None = None,
    warmup: str = "",
) -> list[Row]:
    """The table: numerics against `reference` (skipped when None), then communication and memory
    of every rank against `planner` (default `fivefold.plan.step.plan_step`). A measured step with
    one-time collectives (`warmup`, why) has its communication shown, not judged."""
    from fivefold.plan.activations import planned_activations
    from fivefold.plan.step import plan_step
    from fivefold.support import step_split

    planner = planner or plan_step
    # the pipeline runs the data rank's batch as its schedule's micro-batches, as train splits it
    micro_batch, microbatches = step_split(layout, train.micro_batch, accumulation)
    table: list[Row] = []
    if reference is not None:
        table += _numerics(train, per_rank, reference)
    shape = (spec, layout, micro_batch, train.seq_len, microbatches, train.dtype)  # every rank's
    started = time.perf_counter()
    plans = [
        planner(*shape, r["coords"], r.get("rows_received"), r.get("rows_received_once")) for r in per_rank
    ]
    plan_ms = (time.perf_counter() - started) * 1e3 / len(per_rank)
    table += _communication(layout, per_rank, plans)
    acts = [planned_activations(*shape, r["coords"], r.get("rows_per_forward")) for r in per_rank]
    table += _memory(per_rank, plans, acts)
    if warmup:  # what the step moved and saved is shown; the state bytes are judged all the same
        table = [
            dataclasses.replace(r, name=f"{r.name} (warm-up step)", ok=None)
            if r.judgment == "comm" or r.name.startswith("saved activations")
            else r
            for r in table
        ]
    table.append(Row("plan", "planner time per rank", "-", f"{plan_ms:.3f} ms", 0.0, None))
    return table


def _numerics(train: TrainSpec, per_rank: list[dict], reference: Any) -> list[Row]:
    from fivefold.parallel.compare import RunResult, compare

    params: dict[str, Any] = {}
    for r in per_rank:  # pipeline stages each bring their own layers
        params.update(r["params"])
    missing = sorted(set(reference.params) - set(params))
    if missing:
        return [
            Row("numerics", "parameters", f"{len(missing)} missing, e.g. {missing[0]}", "all", 1.0, False)
        ]
    ours = RunResult(per_rank[0]["losses"], per_rank[0]["grad_norms"], params)
    bf16 = train.dtype == "bf16"
    loss_rtol = BF16_LOSS_RTOL if bf16 else LOSS_RTOL
    # bf16 against the fp32 reference is a coarse check: AdamW moves a weight by at most about lr a
    # step whatever its gradient, and bf16 rounding can flip the sign of a small gradient, so two
    # healthy runs may differ by up to 2·lr per step; beyond that something else is wrong
    param_atol = 2 * train.lr * train.steps if bf16 else PARAM_ATOL
    cmp = compare(reference, ours, loss_rtol, param_atol)
    same = all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
    rows = []
    for i, (a, b, rel) in enumerate(zip(reference.losses, ours.losses, cmp.loss_rel)):
        rows.append(Row("numerics", f"loss step {i + 1}", f"{b:.8f}", f"{a:.8f}", rel, rel <= loss_rtol))
    rows.append(Row("numerics", "loss equal on every rank", str(same), "True", 0.0, same))
    cosine = update_cosine(reference, params)
    if cosine is not None:  # the direction the steps moved the weights, against the single process's
        floor = BF16_UPDATE_COSINE if bf16 else UPDATE_COSINE
        rows.append(
            Row(
                "numerics",
                "update direction (cosine)",
                f"{cosine:.5f}",
                f">= {floor}",
                1 - cosine,
                cosine >= floor,
            )
        )
    rows.append(
        Row(
            "numerics",
            f"updated parameters (max abs diff, {cmp.worst_param or 'none differs'})",
            f"{cmp.max_abs:.3e}",
            f"<= {param_atol:g}",
            cmp.max_rel,
            cmp.max_abs <= param_atol,
        )
    )
    return rows


def update_cosine(reference: Any, params: dict[str, Any]) -> float | None:
    """Cosine between the weights' total update (after the steps less before) in this run and in the
    single process, over every parameter; None without the reference's starting weights. A run that
    did not train (no update) scores 0, one that moved the wrong way below it."""
    if not reference.initial:
        return None
    dot = ours_sq = ref_sq = 0.0
    for name, start in reference.initial.items():
        ref_step = (reference.params[name] - start).double()
        our_step = (params[name].to(start.dtype) - start).double()
        dot += float((ref_step * our_step).sum())
        ref_sq += float((ref_step * ref_step).sum())
        ours_sq += float((our_step * our_step).sum())
    if ref_sq == 0.0:  # the reference did not move (lr 0): nothing to judge the direction by
        return None
    if ours_sq == 0.0:  # this run did not move: no direction at all
        return 0.0
    return dot / (ref_sq * ours_sq) ** 0.5


def _rel(measured: float, planned: float) -> float:
    if measured == planned:
        return 0.0
    return abs(measured - planned) / max(abs(planned), abs(measured), 1.0)


def _communication(layout: Layout, per_rank: list[dict], plans: list[Any]) -> list[Row]:
    """One row per (axis, op): rank 0's numbers shown, every rank judged (the first one off named)."""
    keys: list[tuple[str, str]] = []
    for r, p in zip(per_rank, plans):
        for row in r["ledger"]:
            if (row["axis"], row["op"]) not in keys:
                keys.append((row["axis"], row["op"]))
        keys += [k for k in p.comm if k not in keys]
    rows = []
    for key in keys:
        worst, off = 0.0, None
        for rank, (r, p) in enumerate(zip(per_rank, plans)):
            got = _measured(r, key)
            want = p.comm.get(key, (0, 0))
            diff = max(_rel(got[0], want[0]), _rel(got[1], want[1]))
            if diff > worst or (off is None and got != want):
                worst = max(worst, diff)
                off = off if off is not None else (rank if got != want else None)
        got0, want0 = _measured(per_rank[0], key), plans[0].comm.get(key, (0, 0))
        name = f"{key[0]} {key[1]}" + (f" (rank {off} differs)" if off is not None else "")
        rows.append(
            Row(
                "comm",
                name,
                f"{got0[0]} call{'s' * (got0[0] != 1)}, {got0[1]:,} B",
                f"{want0[0]} call{'s' * (want0[0] != 1)}, {want0[1]:,} B",
                worst,
                off is None,
            )
        )
    if layout.ep > 1:
        got = [r.get("rows_received", 0) for r in per_rank]
        mean = sum(got) / len(got)
        imbalance = max(got) / mean if mean else 1.0
        rows.append(
            Row("comm", "ep routing imbalance (rows received, max/mean)", f"{imbalance:.3f}", "-", 0.0, None)
        )
    return rows


def _measured(r: dict, key: tuple[str, str]) -> tuple[int, int]:
    for row in r["ledger"]:
        if (row["axis"], row["op"]) == key:
            return int(row["count"]), int(row["bytes"])
    return 0, 0


def _memory(per_rank: list[dict], plans: list[Any], acts: list[float]) -> list[Row]:
    """State bytes equal to the plan on every rank; saved activations within ACTIVATION_RTOL."""
    rows = []
    for part in ("params", "grads", "optimizer"):
        off = next(
            (i for i, (r, p) in enumerate(zip(per_rank, plans)) if r["state"][part] != p.state[part]), None
        )
        worst = max(_rel(r["state"][part], p.state[part]) for r, p in zip(per_rank, plans))
        name = f"{part} bytes per rank" + (f" (rank {off} differs)" if off is not None else "")
        got, want = per_rank[0]["state"][part], plans[0].state[part]
        rows.append(Row("memory", name, f"{got:,}", f"{want:,}", worst, off is None))
    diffs = [_rel(r["activations"], a) for r, a in zip(per_rank, acts)]
    # the rank furthest from its plan; among equals, the one that saves the most (not an embedding-only
    # first stage that happens to be rank 0)
    worst_rank = max(range(len(diffs)), key=lambda i: (diffs[i], per_rank[i]["activations"]))
    rows.append(
        Row(
            "memory",
            f"saved activations, peak (worst: rank {worst_rank})",
            f"{per_rank[worst_rank]['activations']:,}",
            f"{int(acts[worst_rank]):,}",
            diffs[worst_rank],
            diffs[worst_rank] <= ACTIVATION_RTOL,
        )
    )
    peak = max(r["process_peak"] for r in per_rank)
    rows.append(Row("memory", "process peak memory (max over ranks)", f"{peak:,}", "-", 0.0, None))
    return rows


def _print_table(
    model: str, layout: Layout, nproc: int, train: TrainSpec, step: int, table: list[Row]
) -> None:
    split = [a for a in ("dp", "fsdp", "tp", "pp", "cp", "ep") if getattr(layout, a) > 1]
    axes = " × ".join(f"{a}{getattr(layout, a)}" for a in split)
    extras = [f"zero {layout.zero}", train.dtype] + (["sp"] if layout.sp else [])
    if layout.cp > 1:
        extras.append(f"cp {layout.cp_impl}")
    if layout.pp > 1:
        extras.append(f"{layout.pp_schedule} m={layout.microbatches}")
    if layout.recompute != "none":
        extras.append(f"recompute {layout.recompute_label}")
    what = f"{axes or 'one replica'} ({', '.join(extras)})"
    print(f"verify {model} on {nproc} ranks: {what}; step {step + 1} measured")
    _print_rows(table)


def _print_rows(table: list[Row]) -> None:
    width = max(len(r.name) for r in table)
    # a numerics row is judged against the single process, the others against the plan
    print(f"  {'judgment':<9} {'row':<{width}}  {'measured':>24}  {'expected':>24}  {'rel diff':>9}  result")
    for r in table:
        result = "-" if r.ok is None else ("PASS" if r.ok else "FAIL")
        values = f"{r.measured:>24}  {r.planned:>24}  {r.diff:>9.2e}"
        print(f"  {r.judgment:<9} {r.name:<{width}}  {values}  {result}")
    print("  (expected: the single process's for numerics rows, the plan's for comm, memory and plan rows)")


# --------------------------------------------------------------------------------------------
# serving: `fivefold generate --nproc N ... --verify`


def judge_serving(served: dict[str, Any], alone: list[list[int]], exact: bool = True) -> list[Row]:
    """The served tokens against one process's (`alone`, the same prompts, sampler and limits), each
    rank's collectives in the prefill and per decoded token against the plan
    (`plan.inference.decode_traffic`), its weights (`rank_weights`) and its KV cache against the plan's
    at the context it reached.
    Calls and bytes must be equal; the expert all-to-alls' bytes follow the router (the plan's rows
    are balanced), so they are shown, not judged; so are the tokens where not `exact` (16-bit weights,
    whose sums in another order can flip a near-tie)."""
    rows = []
    got = [row["tokens"] for row in served["prompts"]]
    differ = [i for i, (a, b) in enumerate(zip(got, alone)) if a != b]
    name = f"tokens of all {len(alone)} prompts" + (f" (prompt {differ[0]} differs)" if differ else "")
    if not exact:
        name += " (16-bit: shown, not judged)"
    first = differ[0] if differ else 0
    verdict = (not differ) if exact else None
    rows.append(Row("numerics", name, _ids(got[first]), _ids(alone[first]), float(bool(differ)), verdict))

    def by_key(listed: list[dict]) -> dict[tuple[str, str], tuple[float, float]]:
        return {(r["axis"], r["op"]): (r["count"], r["bytes"]) for r in listed}

    for phase in ("prefill", "per_token"):
        ranks = [(r["rank"], by_key(r[phase]), by_key(r[f"planned_{phase}"])) for r in served["ledger"]]
        keys = sorted(set().union(*(set(m) | set(p) for _, m, p in ranks)))
        for axis, op in keys:
            routed = (axis, op) == ("ep", "all_to_all")  # bytes follow the router: not judged
            measured, planned, off = [0.0, 0.0], [0.0, 0.0], None
            for rank, m_rows, p_rows in ranks:
                m, p = m_rows.get((axis, op), (0, 0)), p_rows.get((axis, op), (0, 0))
                if (m[0] != p[0] or (m[1] != p[1] and not routed)) and off is None:
                    off = rank
                measured = [measured[0] + m[0], measured[1] + m[1]]
                planned = [planned[0] + p[0], planned[1] + p[1]]
            what = "prefill" if phase == "prefill" else "per token"
            label = f"{axis} {op} {what}, all ranks" + (f" (rank {off} differs)" if off is not None else "")
            note = " (bytes: routed)" if routed else ""
            rows.append(
                Row(
                    "comm",
                    label + note,
                    f"{measured[0]:g} ops, {measured[1]:,.0f} B",
                    f"{planned[0]:g} ops, {planned[1]:,.0f} B",
                    _rel(measured[1], planned[1]),
                    off is None,
                )
            )
    per_rank = served["kv_cache"]
    for what, got, want in (
        ("weight", "weight_bytes", "planned_weight_bytes"),
        ("KV cache", "bytes", "planned_bytes"),
    ):
        off = next((r["rank"] for r in per_rank if r[got] != r[want]), None)
        worst = max((_rel(r[got], r[want]) for r in per_rank), default=0.0)
        label = f"{what} bytes per rank" + (f" (rank {off} differs)" if off is not None else "")
        first = per_rank[0]
        rows.append(Row("memory", label, f"{first[got]:,}", f"{first[want]:,}", worst, off is None))
    return rows


def _ids(tokens: list[int]) -> str:
    text = ",".join(map(str, tokens))
    return text if len(text) <= 24 else text[:21] + "..."


def print_serving(what: str, table: list[Row]) -> None:
    """The serving judgment as `verify` prints a layout's, then PASS or the first failure."""
    print(f"verify {what}")
    _print_rows(table)
    failed = next((r for r in table if r.ok is False), None)
    print("PASS" if failed is None else f"FAIL: {failed.judgment} {failed.name}")
