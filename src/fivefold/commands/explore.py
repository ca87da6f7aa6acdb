"""`fivefold explore`: write one self-contained HTML page of mesh, plan and (optionally) a run."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from fivefold.commands import defaults
from fivefold.config import Layout, add_layout_arguments, check_gpus, say_idle_flags
from fivefold.outputs import check_not_an_input, is_stream, write_text_whole

# every layout field has its flag (config.flags): any of them given draws that layout
_LAYOUT_FLAGS = tuple(f.name for f in fields(Layout))
# the files of a run directory that `explore --run` reads
RUN_READS = ("config.toml", "metrics.jsonl", "ledger.json", "trace.json", "run.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model preset, MODEL.toml or HF config.json (default: the run's)")
    parser.add_argument(
        "--hardware", default=None, help="hardware preset or HW.toml (default: h100-80gb, or cpu for a run)"
    )
    parser.add_argument("--gpus", type=int, default=None, help="world size (default: the run's)")
    parser.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs per node (default: the hardware's)"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096)")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per micro-batch (default 1; on a CPU device train's 8)",
    )
    parser.add_argument("--run", default=None, help="a run directory: its config, loss, ledger and timeline")
    parser.add_argument("--top", type=int, default=5, help="also show the search's best N layouts (0: none)")
    parser.add_argument("--out", default="explore.html", help="where to write the page")
    parser.add_argument(
        "--lab-also",
        action="append",
        default=[],
        metavar="HW:GPUS[:GPUS_PER_NODE]",
        help="also put this cluster in the layout lab (repeatable), e.g. h200:1024",
    )
    parser.add_argument(
        "--no-lab",
        action="store_true",
        help="leave out the layout lab (the planner's result for every layout the search considers)",
    )
    add_layout_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fivefold.config import RunConfig, check_seq_len, layout_from_args, load_hardware, load_model_shape
    from fivefold.errors import FivefoldError
    from fivefold.explore import build_page, train_refuses
    from fivefold.mesh import resolve_layout
    from fivefold.plan import TrainShape
    from fivefold.plan.runshape import DTYPE_BYTES
    from fivefold.support import run_micro_batch

    base = None
    if args.run:
        cfg_path = Path(args.run) / "config.toml"
        if not cfg_path.exists():
            raise FivefoldError(f"{args.run} is not a run directory: config.toml is missing")
        base = RunConfig.from_toml(cfg_path)
        try:  # a hand-edited axis (tp = 0, say) is named here, not as a missing --gpus
            base.layout.resolve(base.layout.world if base.layout.world > 0 else None)
        except FivefoldError as exc:
            raise FivefoldError(f"{cfg_path}: {exc}") from None
    if args.model:
        model, shape_note = load_model_shape(args.model)
        if shape_note:
            print(f"note: {shape_note}", file=sys.stderr)
    elif base:
        model = base.model
    else:
        raise FivefoldError("give --model (a preset, MODEL.toml or config.json) or --run DIR")
    assumed: dict[str, object] = {}
    if args.hardware is None and not (base and not args.model):
        assumed["hardware"] = defaults.HARDWARE
    hw = load_hardware(args.hardware or ("cpu" if base and not args.model else defaults.HARDWARE))
    layout = layout_from_args(args, base.layout if base else None)
    given = base is not None or any(getattr(args, f) is not None for f in _LAYOUT_FLAGS)
    if args.top < 0:
        raise FivefoldError(f"--top must be >= 0 (0: no search), got {args.top}")
    for flag in ("gpus", "gpus_per_node", "seq_len", "global_batch", "micro_batch"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise FivefoldError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    gpus = args.gpus or (base.layout.world if base else None)
    if not gpus:
        raise FivefoldError("give --gpus N (the world size)")
    check_gpus(gpus)
    if not args.seq_len and not base:
        assumed["seq_len"] = defaults.seq_len(model.max_seq_len, hw)
    seq_len = args.seq_len or (base.train.seq_len if base else defaults.seq_len(model.max_seq_len, hw))
    check_seq_len(model, seq_len)  # as train checks it: the model's positions bound a sequence
    resolved = resolve_layout(layout, gpus, model=model) if given else None
    # on a CPU device what is left out is train's, as `plan` takes it: the page plans the run train makes
    trains_here = not base and defaults.on_a_cpu(hw)
    micro = args.micro_batch or (base.train.micro_batch if base else (defaults.micro_batch(hw) or 1))
    if trains_here and not args.micro_batch:
        assumed["micro_batch"] = micro
    if not args.global_batch and not base:
        data_ranks = resolved.data_parallel if resolved is not None else 0
        assumed["global_batch"] = defaults.global_batch(gpus, seq_len, micro, hw, data_ranks)
    global_batch = args.global_batch or (
        base.train.step_batch(layout.data_parallel) if base else int(assumed["global_batch"])
    )
    if base and not args.micro_batch:  # the run's split, as `plan --validate RUN_DIR` reads it
        micro = run_micro_batch(layout, micro, global_batch)
    elif trains_here and not args.micro_batch and resolved is not None:  # train's pipeline split
        micro = run_micro_batch(resolved, micro, global_batch)

    # a run is planned in its own dtype (fp32 by default), so the page's plan and ledger agree; a CPU
    # device's plan in train's
    width = DTYPE_BYTES[base.train.dtype if base else defaults.dtype(hw)]
    # and with its own kernels: eager ones, or a compiled run's fused ones (what they stream and keep)
    compiled = bool(base and base.train.compile)
    shape = TrainShape(
        seq_len=seq_len,
        global_batch=global_batch,
        micro_batch=micro,
        act_bytes=width,
        param_bytes=width,
        fused=compiled,
        saved_as_eager=not compiled,
    ).validate()
    out = Path(args.out)
    read = [args.model, args.hardware]
    if args.run:
        read += [Path(args.run) / name for name in RUN_READS]
    check_not_an_input(out, read)
    if out.is_dir():
        raise FivefoldError(f"--out {out} is a directory: give the path of the page to write")
    if out.suffix.lower() not in ("", ".html", ".htm") and not is_stream(out):  # a page named x.svg
        raise FivefoldError(f"--out writes an HTML page: give a FILE.html (got --out {out})")
    also = [_cluster(text, load_hardware) for text in args.lab_also]
    html = build_page(
        model,
        hw,
        gpus,
        shape,
        resolved,
        args.gpus_per_node,
        args.run,
        args.top,
        lab=not args.no_lab,
        lab_also=also,
    )
    write_text_whole(out, html)
    defaults.say_assumed(assumed)
    if resolved is not None:
        say_idle_flags(args, resolved)
    if resolved is not None and (refused := train_refuses(model, resolved, seq_len)):
        print(f"note: fivefold train refuses this layout: {refused}")
    elif resolved is not None and not args.microbatches:  # as plan says it
        from fivefold.plan import plan
        from fivefold.plan.text import train_split_hint

        gpn = args.gpus_per_node or hw.gpus_per_node
        if hint := train_split_hint(plan(model, hw, resolved, shape, gpn)):
            print(f"note: {hint}")
    print(f"wrote {out} ({len(html) / 1e3:.0f} kB): open it in a browser")
    return 0


def _cluster(text: str, load_hardware):  # noqa: ANN001 - the loader is passed to keep imports lazy
    """'h200:1024' or 'h200:1024:8' -> (hardware, GPUs, GPUs per node)."""
    from fivefold.errors import FivefoldError

    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(p.strip().isdigit() and int(p) > 0 for p in parts[1:]):
        raise FivefoldError(
            f"--lab-also {text!r}: expected HW:GPUS or HW:GPUS:GPUS_PER_NODE with positive integers"
        )
    check_gpus(int(parts[1]), f"--lab-also {text!r}: GPUS")  # the lab searches layouts of that world
    hw = load_hardware(parts[0])
    per_node = int(parts[2]) if len(parts) == 3 else hw.gpus_per_node
    check_gpus(per_node, f"--lab-also {text!r}: GPUS_PER_NODE")
    return hw, int(parts[1]), per_node
