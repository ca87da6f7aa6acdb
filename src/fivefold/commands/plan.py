"""`fivefold plan`: predict memory, communication, bubble, step time and MFU; `--search` the best layout."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from fivefold.commands import defaults
from fivefold.config import add_layout_arguments, check_gpus, check_pins
from fivefold.config.layout import MAX_GPUS
from fivefold.config.run import MAX_BATCH
from fivefold.plan.trainers import TRAINER_FLAGS


def named_trainer_facts(flag: str, hw) -> dict | None:  # noqa: ANN001 - HardwareSpec, imported lazily
    """The facts of `--trainer` on this hardware (None for fivefold's own runtime): what its plans
    assume and what its search may propose."""
    if flag == "fivefold":
        return None
    from fivefold.plan.trainers import hopper_or_newer, trainer_facts

    return trainer_facts(TRAINER_FLAGS[flag], hopper_or_newer(hw.name))


def trainer_shape(flag: str, hw) -> tuple[dict, str]:  # noqa: ANN001 - HardwareSpec, imported lazily
    """(TrainShape fields, attention kernel) of `--trainer`: fivefold's runtime as TrainShape's defaults
    say it, or another trainer's facts as the published runs of it are planned (fivefold.plan.trainers)."""
    from fivefold.plan.trainers import hopper_or_newer, kernel_on, sdpa_attention, shape_facts

    trainer = named_trainer_facts(flag, hw)
    if trainer is None:
        return {}, sdpa_attention(hopper_or_newer(hw.name))

    return shape_facts(trainer), kernel_on(str(trainer.get("attention", "flash")), hopper_or_newer(hw.name))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model preset, MODEL.toml or HF config.json")
    parser.add_argument(
        "--hardware", default=None, help=f"hardware preset or HW.toml (default: {defaults.HARDWARE}, said so)"
    )
    parser.add_argument("--gpus", type=int, default=None, help="world size")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the hardware's")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help=f"tokens per sequence (default: {defaults.SEQ_LEN}, said so)",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step (default: about 4M tokens, a multiple of --gpus; said so)",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per micro-batch (default 1, on a CPU device train's 8; searched)",
    )
    parser.add_argument(
        "--mode",
        choices=("train", "inference"),
        default="train",
        help="plan a training step or serving (prefill + decode)",
    )
    parser.add_argument(
        "--search",
        action="store_true",
        help="rank every valid layout that fits; layout flags given stay fixed, the rest is searched",
    )
    parser.add_argument(
        "--trainer",
        choices=tuple(TRAINER_FLAGS),
        default="fivefold",
        help="whose implementation to plan: fivefold's runtime (default) or another trainer's facts "
        "(kernels, tp overlap, sequence-parallel re-gathers, gradient dtype, cp cores; docs/planner.md)",
    )
    parser.add_argument(
        "--attention",
        choices=("flash", "flash3", "materialized"),
        default=None,
        help="attention kernel: flash (FlashAttention-2 class), flash3 (Hopper: FA3, cuDNN) or "
        "materialized s×s scores (2021-22 Megatron kernels); default: the trainer's (fivefold's: what "
        "the installed torch's SDPA runs there, flash3 on Hopper from torch 2.11, else flash)",
    )
    parser.add_argument("--fp8", action="store_true", help="matmuls in fp8 (Transformer Engine, float8)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the trainer runs under torch.compile (`train --compile`): fused elementwise kernels, and "
        "the activations they save; default: fivefold's eager runtime, whose saved tensors are counted "
        "one by one",
    )
    runs = parser.add_argument_group("validation against published runs")
    runs.add_argument(
        "--validate",
        nargs="*",
        metavar="RUNS.toml",
        default=None,
        help="predicted vs published for every run (default: the bundled reference sets); given "
        "files or run directories with --hardware are planned on that hardware (a --calibrate file)",
    )
    runs.add_argument(
        "--cross-validate",
        nargs="*",
        metavar="RUNS.toml",
        default=None,
        help="leave-one-source-out error beside the median-constant predictor's (default: bundled sets)",
    )
    runs.add_argument(
        "--calibrate",
        nargs="+",
        metavar="RUNS.toml|RUN_DIR",
        default=None,
        help="fit the hardware knobs to these runs (TOML files or run directories) and write a "
        "hardware TOML (see --out)",
    )
    runs.add_argument("--out", default=None, help="--calibrate: hardware TOML to write (default: stdout)")
    runs.add_argument(
        "--plot",
        default=None,
        metavar="FILE.svg",
        help="--validate / --cross-validate: also draw predicted against published MFU, one dot a run "
        "(leave-one-source-out with --cross-validate)",
    )
    parser.add_argument("--top", type=int, default=5, help="layouts to show with --search")
    parser.add_argument(
        "--block",
        choices=("auto", "llama", "gpt"),
        default="auto",
        help="layer implementation: llama (SwiGLU, RMSNorm) or gpt (GeLU MLP, LayerNorm, tied "
        "embeddings); auto: gpt for MHA with a 4h MLP. The attention kernel is --attention's",
    )
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="compute dtype of activations and gathered weights (default bf16; fp32 on --hardware cpu, "
        "as `fivefold train` runs there)",
    )
    parser.add_argument(
        "--grad-dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="gradient accumulation dtype (fp32: Megatron/FSDP2; bf16: the ZeRO paper's fp16); default: "
        "the trainer's (fp32, bf16 for NeMo)",
    )
    parser.add_argument(
        "--no-overlap-grad-reduce",
        action="store_true",
        help="data-parallel gradient reduction does not overlap the backward",
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="inference: concurrent sequences per replica (default 1)"
    )
    parser.add_argument("--context", type=int, default=None, help="inference: prompt + generated tokens")
    parser.add_argument(
        "--prompt", type=int, default=None, help="inference: prompt tokens (default: half the context)"
    )
    parser.add_argument(
        "--objective",
        choices=("latency", "throughput"),
        default=None,
        help="inference --search: rank by decode time per token (latency, the default) or by tokens/s "
        "(throughput)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_layout_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import json

    from fivefold.config import (
        check_seq_len,
        layout_from_args,
        load_hardware,
        load_model_shape,
        say_idle_flags,
    )
    from fivefold.errors import FivefoldError
    from fivefold.mesh import resolve_layout

    modes = [f for f in ("validate", "cross_validate", "calibrate") if getattr(args, f) is not None]
    if len(modes) > 1 or (modes and args.search):  # each answers another question: one at a time
        said = " and ".join(
            "--" + f.replace("_", "-") for f in [*modes, *(["search"] if args.search else [])]
        )
        raise FivefoldError(f"{said} are separate questions; give one of them")
    if modes:
        from fivefold.commands.plan_runs import run_runs

        return run_runs(args)
    idle = {  # a file the user expects would silently not appear
        "out": "--out names the hardware TOML that --calibrate writes",
        "plot": "--plot names the SVG of --validate's or --cross-validate's predictions",
    }
    for flag, what in idle.items():
        if getattr(args, flag, None) is not None:
            raise FivefoldError(f"{what}; a plan writes no file (--json prints it for a program)")
    for flag in ("model", "gpus"):
        if getattr(args, flag) is None:
            raise FivefoldError(f"--{flag} is required (unless --validate, --cross-validate or --calibrate)")
    model, shape_note = load_model_shape(args.model)
    if shape_note:
        print(f"note: {shape_note}", file=sys.stderr)
    check_gpus(args.gpus)
    for flag in ("gpus_per_node", "seq_len", "global_batch", "micro_batch", "context", "batch", "prompt"):
        value = getattr(args, flag, None)
        if value is not None and value <= 0:
            raise FivefoldError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
        # beyond these the float arithmetic of a plan stops meaning anything (a step shorter than its
        # compute); no cluster or batch comes near them
        ceiling = MAX_GPUS if flag == "gpus_per_node" else MAX_BATCH
        if value is not None and value > ceiling:
            raise FivefoldError(f"--{flag.replace('_', '-')} must be at most {ceiling:,}, got {value:.3g}")
    if args.top < 0:
        raise FivefoldError(f"--top must be >= 0 (0: every layout that fits), got {args.top}")
    # said on stderr once the plan stands, so that an error stays the only line
    assumed: dict[str, object] = {}
    if args.hardware is None:
        args.hardware = assumed["hardware"] = defaults.HARDWARE
    hw = load_hardware(args.hardware)
    gpn = args.gpus_per_node or hw.gpus_per_node
    if args.mode == "inference":
        args.batch = 1 if args.batch is None else args.batch
        args.objective = args.objective or "latency"
        return _inference(args, model, hw, gpn, assumed)
    # flags of the serving plan: a training plan has nothing to do with them, which whoever typed them
    # did not expect
    _say_ignored(args, ("batch", "context", "prompt", "objective"), "--mode inference", "this training plan")
    from fivefold.layout_math import stage_split
    from fivefold.plan import TrainShape, plan
    from fivefold.plan import text as view
    from fivefold.plan.runshape import DTYPE_BYTES
    from fivefold.plan.search import search

    if args.seq_len is None:
        args.seq_len = assumed["seq_len"] = defaults.seq_len(model.max_seq_len, hw)
    check_seq_len(model, args.seq_len)  # as train checks it: the model's positions bound a sequence
    # on a CPU device, where train runs, what is left out is train's: the plan is of the run it makes
    trains_here = defaults.on_a_cpu(hw) and args.micro_batch is None
    layout = None
    if not args.search:
        layout = resolve_layout(layout_from_args(args), args.gpus, gpn, model, args.seq_len)
        # a bad --pp-split is named before the batch's split, in the order train names them
        stage_split(model, layout, args.seq_len)
        if trains_here:  # (a search keeps choosing the micro-batch)
            args.micro_batch = assumed["micro_batch"] = defaults.micro_batch(hw)
    if args.global_batch is None:
        args.global_batch = assumed["global_batch"] = defaults.global_batch(
            args.gpus,
            args.seq_len,
            args.micro_batch or defaults.micro_batch(hw) or 1,
            hw,
            layout.data_parallel if layout is not None else 0,
        )
    if args.dtype is None:  # what train runs on a CPU (fp32), what GPU training runs elsewhere
        args.dtype = defaults.dtype(hw)
    if args.fp8 and args.dtype == "fp32":
        raise FivefoldError(
            "--fp8 runs the matmuls in fp8 beside 16-bit activations; use it with --dtype bf16"
        )
    facts, attention = trainer_shape(args.trainer, hw)
    trainer = named_trainer_facts(args.trainer, hw)  # what the search may propose, the note says
    if args.grad_dtype is not None:
        facts["grad_bytes"] = 4 if args.grad_dtype == "fp32" else 2
    if args.compile:  # fused kernels keep Korthikanti et al.'s tensors, not the eager code's
        facts.update(fused=True, saved_as_eager=False)
    shape = TrainShape(
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch or 1,
        act_bytes=DTYPE_BYTES[args.dtype],
        param_bytes=DTYPE_BYTES[args.dtype],
        block=args.block,
        overlap_grad_reduce=not args.no_overlap_grad_reduce,
        attention=args.attention or attention,
        fp8=args.fp8,
        **facts,
    ).validate()
    if args.search:
        from fivefold.plan.search import PINNABLE

        # what the search chooses itself and cannot keep: refused, not dropped in silence
        for flag, chosen in (
            ("pp_split", "the cost-balanced stage split"),
            ("microbatches", "--global-batch over --micro-batch and the data ranks"),
        ):
            if getattr(args, flag, None) is not None:
                raise FivefoldError(
                    f"--{flag.replace('_', '-')} is not kept by --search, which takes {chosen}; drop it, "
                    "or plan that layout without --search"
                )
        if args.recompute_layers and args.recompute is None:  # refused as a plan without --search is
            from fivefold.config import Layout

            Layout(recompute_layers=args.recompute_layers).resolve()
        pins = {k: getattr(args, k, None) for k in PINNABLE}
        pins["micro_batch"] = args.micro_batch
        check_pins(pins, args.gpus)
        result = search(model, hw, args.gpus, shape, gpn, top=args.top, pins=pins, trainer=trainer)
        if result.input_error:  # the inputs (batch, pins) leave no layout to size: not an answer
            raise FivefoldError(result.explanation[0])
        defaults.say_assumed(assumed)
        _print_search(result, args.json, view.search_text, seconds=result.seconds)
        return 0
    say_idle_flags(args, layout)
    data = layout.data_parallel
    # train's pipelined split: --microbatches given, or train's micro-batch taken as a data rank's batch
    split = args.microbatches or (trains_here and "micro_batch" in assumed)
    if split and layout.pp > 1 and args.global_batch % data == 0:
        # as train reads it: a data rank's batch for the step split into that many pipeline micro-batches;
        # --micro-batch, train's unit of accumulation, has only to divide that batch (a batch the data
        # ranks do not share evenly is refused below, as without --microbatches)
        from fivefold.config import TrainSpec
        from fivefold.support import pipeline_micro_batch

        if args.micro_batch:
            TrainSpec(micro_batch=args.micro_batch, global_batch=args.global_batch).grad_accum(data)
        shape = dataclasses.replace(
            shape, micro_batch=pipeline_micro_batch(layout, args.global_batch // data)
        )
    p = plan(model, hw, layout, shape, gpn)
    if not args.microbatches and (hint := view.train_split_hint(p)):
        p.notes.append(hint)
    if args.trainer != "fivefold":
        p.notes.append(f"planned with the facts of {TRAINER_FLAGS[args.trainer]} (--trainer {args.trainer})")
    defaults.say_assumed(assumed)
    nearest = None
    if p.margin_bytes < 0:
        pinned = search(model, hw, args.gpus, shape, gpn, top=1, pins=_given_pins(args), trainer=trainer)
        nearest = _nearest_fit(p, args, pinned, trainer)
    if args.json:
        # a program reads the way out of a layout that does not fit as a person reads it in the text
        print(json.dumps(p.to_json() | {"nearest_fit": nearest}))
        return 0
    if p.margin_bytes < 0:
        print(_does_not_fit(p, nearest))
    print(view.plan_text(p))
    from fivefold.support import check_trainable  # a plan may predict what only other frameworks run

    try:
        check_trainable(model, layout, args.seq_len)
    except FivefoldError as exc:
        print(f"note: fivefold train refuses this layout: {exc}")
    from fivefold.plan.trainers import trainer_refuses

    if trainer is not None and (why := trainer_refuses(trainer, layout)):
        print(f"note: {TRAINER_FLAGS[args.trainer]} does not run this layout: {why}")
    return 0


def _print_search(result, as_json: bool, text, **extra) -> None:  # noqa: ANN001 - either search's result
    """A training or serving search: its ranked plans as text, or as JSON with what was considered."""
    import json

    if not as_json:
        print(text(result))
        return
    summary = extra | {
        "considered": result.considered,
        "fitting": result.fitting,
        "explanation": result.explanation,
    }
    print(json.dumps({"search": summary, "plans": [p.to_json() for p in result.plans]}))


def _given_pins(args: argparse.Namespace) -> dict:
    """The layout flags the user typed, for a search that keeps them where it can."""
    from fivefold.plan.search import PINNABLE

    return {k: getattr(args, k, None) for k in PINNABLE if getattr(args, k, None) is not None}


def _shape_flags(args: argparse.Namespace) -> str:
    """The flags besides the layout that change a plan, as typed (for a command to run again)."""
    out = ""
    typed = (("gpus_per_node", None), ("trainer", "fivefold"), ("attention", None), ("block", "auto"))
    for flag, default in (*typed, ("dtype", None), ("grad_dtype", None)):
        if getattr(args, flag, default) != default:
            out += f" --{flag.replace('_', '-')} {getattr(args, flag)}"
    out += " --fp8" if getattr(args, "fp8", False) else ""
    out += " --compile" if getattr(args, "compile", False) else ""
    return out + (" --no-overlap-grad-reduce" if getattr(args, "no_overlap_grad_reduce", False) else "")


def _nearest_fit(p, args: argparse.Namespace, pinned, trainer: dict | None) -> dict | None:  # noqa: ANN001
    """The nearest layout that fits a plan that does not: the pinned search's best (the typed flags
    kept), else the free search's, among what `trainer` runs (as the pinned one); None where no
    layout fits. `command` plans it again."""
    from fivefold.plan.search import plan_flags, search

    found, kept = pinned, True
    if not found.plans:
        found = search(p.model, p.hardware, p.gpus, p.shape, p.gpus_per_node, top=1, trainer=trainer)
        kept = False
    if not found.plans:
        return None
    best = found.plans[0]
    command = (
        f"fivefold plan --model {args.model} --hardware {args.hardware} --gpus {p.gpus} "
        f"--seq-len {p.shape.seq_len} --global-batch {p.shape.global_batch} {plan_flags(best)}"
        f"{_shape_flags(args)}"
    )
    return {"keeps_given_flags": kept, "mfu": best.mfu, "command": command, "plan": best.to_json()}


def _does_not_fit(p, nearest: dict | None) -> str:  # noqa: ANN001 - Plan
    """The first lines of a plan that does not fit: by how much, and the nearest layout that does."""
    from fivefold.plan.result import fit_words

    lines = [f"this layout {fit_words(p.margin_bytes)} per GPU: the figures below cannot be run as they are"]
    if nearest is not None:
        kept = "keeping the flags you gave"
        if not nearest["keeps_given_flags"]:
            kept = "the flags you gave cannot fit; the best layout"
        lines.append(f"nearest that fits ({kept}, MFU {nearest['mfu']:.1%}): {nearest['command']}")
    else:
        lines.append(f"no layout of {p.model.name} fits {p.gpus} × {p.hardware.name}: add GPUs")
    return "\n".join(lines) + "\n"


def _say_ignored(args: argparse.Namespace, flags: tuple[str, ...], whose: str, plan: str) -> None:
    """One note on stderr for each of `flags` given that `plan` has no use for (a flag of `whose`)."""
    for flag in flags:
        value = getattr(args, flag, None)
        if value is not None and value is not False:  # (--zero 0 is given: 0 is no None)
            print(
                f"note: --{flag.replace('_', '-')} is a flag of {whose}; {plan} ignores it", file=sys.stderr
            )


# `plan` flags a serving plan has no use for (--mode inference)
TRAINING_ONLY = (
    "global_batch",
    "micro_batch",
    "zero",
    "recompute",
    "recompute_layers",
    "pp_schedule",
    "microbatches",
    "virtual_stages",
    "grad_dtype",
    "no_overlap_grad_reduce",
    "fp8",
    "compile",
    "sp",  # generate's tp all-reduces whole activations; its cp gathers partial attention outputs
    "cp_impl",
    "attention",  # a serving plan's attention is the decode kernel's, read off the KV cache
)


def _inference(args: argparse.Namespace, model, hw, gpn: int, assumed: dict) -> int:
    import json

    from fivefold.config import check_seq_len, layout_from_args
    from fivefold.errors import FivefoldError
    from fivefold.mesh import resolve_layout
    from fivefold.plan import text as view
    from fivefold.plan.inference import InferenceShape, inference_plan
    from fivefold.plan.runshape import DTYPE_BYTES

    context = args.context or args.seq_len
    if not context:  # as training's --seq-len: the model's positions, at most the default, said so
        context = assumed["context"] = defaults.seq_len(model.max_seq_len)
    check_seq_len(model, context, "--context", shortest=2)  # as training's --seq-len: the model's positions
    prompt = args.prompt if args.prompt is not None else context // 2
    if not 0 < prompt < context:
        raise FivefoldError(
            f"--prompt {prompt} with --context {context} generates no token: the context holds the prompt "
            f"and the generated tokens; valid prompt: 1..{context - 1}"
        )
    # weights and KV cache in --dtype; left out, what generate holds a fivefold model in on a CPU
    # device (fp32, the weights' own), bf16 elsewhere
    size = DTYPE_BYTES[args.dtype or defaults.dtype(hw)]
    shape = InferenceShape(
        batch=args.batch, context=context, prompt=prompt, weight_bytes=size, kv_bytes=size
    ).validate()
    # flags of the training plan: serving has no optimizer, backward or micro-batches, which whoever
    # typed them did not expect (the training plan says the same of the serving flags)
    _say_ignored(args, TRAINING_ONLY, "a training plan", "this serving plan")
    if args.trainer != "fivefold":  # (its default is a value, not None)
        _say_ignored(args, ("trainer",), "a training plan", "this serving plan")
    if args.search:
        from fivefold.plan.inference import search_serving

        pins = {k: getattr(args, k, None) for k in ("tp", "pp", "cp", "ep")}
        check_pins(pins, args.gpus)
        result = search_serving(model, hw, args.gpus, shape, gpn, args.objective, args.top, pins, args.block)
        defaults.say_assumed(assumed)
        _print_search(result, args.json, view.serving_search_text, objective=result.objective)
        return 0
    layout = layout_from_args(args)
    if args.fsdp is None:  # serving replicas sit on the fsdp axis so that ep can fold onto them
        layout.fsdp, layout.dp = (layout.dp if args.dp is not None else -1), 1
    layout = resolve_layout(layout, args.gpus, gpn, model, args.seq_len)
    p = inference_plan(model, hw, layout, shape, gpn, args.block)
    defaults.say_assumed(assumed)
    nearest = None if p.fits else _serving_nearest_fit(p, args, gpn)
    if args.json:
        print(json.dumps(p.to_json() | {"nearest_fit": nearest}))
        return 0
    if not p.fits:
        print(_serving_does_not_fit(p, nearest, args.objective))
    print(view.inference_text(p))
    return 0


def _serving_nearest_fit(p, args: argparse.Namespace, gpn: int) -> dict | None:  # noqa: ANN001 - InferencePlan
    """The nearest serving layout that fits, as a training plan's: the typed tp/pp/cp/ep kept where
    possible, else the best; None where none fits. `command` plans it again."""
    from fivefold.errors import FivefoldError
    from fivefold.plan.inference import search_serving

    typed = {k: getattr(args, k, None) for k in ("tp", "pp", "cp", "ep")}
    typed = {k: v for k, v in typed.items() if v is not None}
    found, kept = None, True
    if typed:
        try:
            found = search_serving(
                p.model, p.hardware, p.layout.world, p.shape, gpn, args.objective, 1, typed, args.block
            )
        except FivefoldError:  # a typed degree no serving layout has: fall back to the free search
            found = None
    if found is None or not found.plans:
        found = search_serving(
            p.model, p.hardware, p.layout.world, p.shape, gpn, args.objective, 1, None, args.block
        )
        kept = False
    if not found.plans:
        return None
    best = found.plans[0]
    flags = " ".join(
        f"--{a} {getattr(best.layout, a)}" for a in ("tp", "pp", "cp", "ep") if getattr(best.layout, a) > 1
    )
    command = (
        f"fivefold plan --model {args.model} --hardware {args.hardware} --gpus {p.layout.world} "
        f"--mode inference --context {p.shape.context} --prompt {p.shape.prompt} --batch {p.shape.batch} "
        f"{flags}".rstrip()
    )
    return {"keeps_given_flags": kept, "typed": bool(typed), "command": command, "plan": best.to_json()}


def _serving_does_not_fit(p, nearest: dict | None, objective: str) -> str:  # noqa: ANN001 - InferencePlan
    """The first lines of a serving plan that does not fit: by how much, and the nearest that does."""
    from fivefold.plan.result import capacity, fit_words

    margin = capacity(p.hardware) - p.total
    lines = [f"this layout {fit_words(margin)} per GPU: the figures below cannot be served as they are"]
    if nearest is None:
        lines.append(
            f"no serving layout of {p.model.name} fits {p.layout.world} × {p.hardware.name}: add GPUs"
        )
    else:
        kept = (
            "keeping the flags you gave"
            if nearest["keeps_given_flags"]
            else ("the flags you gave cannot fit; the best layout" if nearest["typed"] else "the best layout")
        )
        lines.append(f"nearest that fits ({kept}, {objective}): {nearest['command']}")
    return "\n".join(lines) + "\n"
