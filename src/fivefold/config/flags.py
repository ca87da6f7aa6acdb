"""The layout flags every command shares: one definition, one default, one help text."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Collection
from dataclasses import fields

from fivefold.config.layout import CP_IMPLS, DEFAULT_ORDER, PP_SCHEDULES, RECOMPUTE, Layout


def add_layout_arguments(
    parser: argparse.ArgumentParser, factors_only: bool = False, axes: tuple[str, ...] | None = None
) -> None:
    """The layout flags, one definition for every command. `factors_only`: the axis sizes and their
    order, for commands that only place ranks (`mesh`) and would ignore the rest; `axes`: only these
    axis sizes (`generate`, which serves on dp, tp, pp, cp and ep)."""
    g = parser.add_argument_group("layout")
    for axis, text in (
        ("dp", "replicated data-parallel degree (-1: fill the world)"),
        ("fsdp", "sharded data-parallel degree (-1: fill the world)"),
        ("tp", "tensor-parallel degree (default 1)"),
        ("pp", "pipeline-parallel degree (default 1)"),
        ("cp", "context-parallel degree (default 1)"),
        ("ep", "expert-parallel degree, folded onto fsdp×cp ranks (generate: the replicas) (default 1)"),
    ):
        if axes is None or axis in axes:
            g.add_argument(f"--{axis}", type=int, default=None, help=text)
    if axes is not None:
        return
    g.add_argument(
        "--order",
        default=None,
        help=f"axes innermost (adjacent ranks) first; any subset, the rest follow in the default order "
        f"(default {DEFAULT_ORDER})",
    )
    if factors_only:
        return
    g.add_argument(
        "--zero",
        type=int,
        default=None,
        choices=(0, 1, 2, 3),
        help="ZeRO stage: 1 shards optimizer state, 2 also grads, 3 also params "
        "(default 3 with fsdp, else 0)",
    )
    g.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallelism on top of tensor parallelism",
    )
    g.add_argument(
        "--pp-schedule",
        default=None,
        choices=PP_SCHEDULES,
        help="pipeline schedule (default 1f1b, or interleaved-1f1b with --virtual-stages above 1); "
        "interleaved/zbv/dualpipev run several chunks per rank",
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline micro-batches a data rank's batch is split into per step (default: 2 × pp in "
        "train; in plan, the rank's batch over --micro-batch)",
    )
    g.add_argument(
        "--virtual-stages", type=int, default=None, help="model chunks per pipeline rank (default 1)"
    )
    g.add_argument("--pp-split", default=None, help="manual layers per stage, e.g. 3,5,5,3")
    g.add_argument(
        "--cp-impl",
        default=None,
        choices=CP_IMPLS,
        help="context-parallel attention: ring passes K/V blocks rank to rank, allgather gathers them, "
        "ulysses trades sequence for heads with all-to-all (default ring)",
    )
    g.add_argument(
        "--recompute",
        default=None,
        choices=RECOMPUTE,
        help="activation recomputation: full re-runs each block in the backward, selective only the "
        "attention core (default none)",
    )
    g.add_argument(
        "--recompute-layers",
        type=int,
        default=None,
        metavar="N",
        help="with --recompute full: re-run only the first N blocks of every model chunk (pipeline "
        "stage or virtual stage) and keep the rest's activations (default 0: all blocks)",
    )


def layout_from_args(
    args: argparse.Namespace, base: Layout | None = None, base_says: Collection[str] | None = None
) -> Layout:
    """Overlay the layout flags that were given on `base` (unresolved: call .resolve(world)), and read
    what is left out as every command reads it: with neither --dp nor --fsdp (here, or among the fields
    `base_says`; a base without that list says all), dp fills what the other axes leave; --virtual-stages
    above 1 without --pp-schedule is the interleaved 1F1B (1F1B runs one chunk a rank)."""
    lay = dataclasses.replace(base) if base else Layout()
    for f in fields(Layout):
        value = getattr(args, f.name, None)
        if value is not None:
            setattr(lay, f.name, value)
    said = set(base_says if base_says is not None else ([f.name for f in fields(Layout)] if base else []))
    flagged = {a for a in ("dp", "fsdp") if getattr(args, a, None) is not None}
    if not ({"dp", "fsdp"} & (said | flagged)):
        lay.dp = -1
    virtual = getattr(args, "virtual_stages", None)
    if virtual and virtual > 1 and getattr(args, "pp_schedule", None) is None and lay.pp_schedule == "1f1b":
        lay.pp_schedule = "interleaved-1f1b"
    return lay


# Flags that refine one axis, and say nothing while that axis has size 1.
_REFINES = (
    ("sp", "tp", "--sp shards the activations tensor parallelism replicates"),
    ("cp_impl", "cp", "--cp-impl picks how context-parallel ranks share K and V"),
    ("pp_schedule", "pp", "--pp-schedule orders a pipeline's micro-batches"),
    ("microbatches", "pp", "--microbatches splits a pipeline's batch into micro-batches"),
)


def say_idle_flags(args: argparse.Namespace, layout: Layout) -> None:
    """One line on stderr for each refining flag given for an axis `layout` leaves at 1 (tp, cp and pp
    are never filled from the world, so an unresolved layout will do): the layout is still valid, the
    flag has nothing to act on, but whoever typed it expected it to act."""
    for flag, axis, what in _REFINES:
        value = getattr(args, flag, None)
        if value in (None, False) or getattr(layout, axis) != 1:
            continue
        if type(value) is int and value <= 0:  # a count out of range: its own error says so, alone
            continue
        note = f"note: {what}; {axis} is 1 here, so it has no effect (add --{axis} 2 or more)"
        print(note, file=sys.stderr)
    # ZeRO refines the data ranks (dp, which may be left to fill the world: said only once known)
    if getattr(args, "zero", None) and layout.dp > 0 and layout.dp * layout.fsdp * layout.cp == 1:
        print(
            "note: --zero shards the optimizer state (and gradients, weights) over the data-parallel ranks; "
            "dp×fsdp is 1 here, so it has no effect (add --fsdp 2 or more)",
            file=sys.stderr,
        )
