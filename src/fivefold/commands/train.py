"""`fivefold train`: train a transformer on a layout (CPU/gloo or GPU/NCCL).

    fivefold train --model PRESET|PATH --steps N --seed S --dtype fp32|bf16 --nproc N --run-dir DIR
                   [--config FILE.toml] [train knobs] [layout flags]

Precedence: built-in defaults < `--config` file < explicit flags. `--nproc N` starts N local ranks
through torch's elastic launcher; under `torchrun -m fivefold.train` the same flags apply and the
launcher's world is used instead.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import sys
from dataclasses import fields, replace
from pathlib import Path

from fivefold.config import (
    Layout,
    ModelSpec,
    RunConfig,
    TrainSpec,
    _from_dict,
    add_layout_arguments,
    layout_from_args,
    load_model,
    run_tables,
    say_idle_flags,
)
from fivefold.errors import FivefoldError
from fivefold.parallel.compile import check_compile
from fivefold.parallel.spawn import MAX_LOCAL_RANKS
from fivefold.train import supervise
from fivefold.train.checkpoint import remove_unfinished
from fivefold.train.launch import TrainJob, launch, run_job
from fivefold.train.loop import preflight, run_dir_holder, runtime_layout

# flag -> TrainSpec field (flags use dashes, the spec underscores)
TRAIN_FLAGS: dict[str, tuple[type, str]] = {
    "steps": (int, "optimizer steps"),
    "seed": (int, "seed of the weights and of the batch order"),
    "lr": (float, "peak learning rate"),
    "seq_len": (int, "tokens per sequence"),
    "micro_batch": (
        int,
        "sequences per rank per forward; with pp, a data rank's, split into --microbatches",
    ),
    "global_batch": (int, "sequences per optimizer step; 0: micro-batch × data-parallel ranks"),
    "warmup": (int, "learning-rate warm-up steps"),
    "eval_every": (int, "held-out loss every N steps and at the end"),
    "checkpoint_every": (int, "checkpoint every N steps; 0: only at the end, -1: never"),
    "data": (str, "stdlib (default), a text file or folder, .jsonl or a pre-tokenized .bin"),
    "tokenizer": (str, "bytes (default) or a tokenizer.json / HF directory"),
    "device": (str, "auto (default), cpu or cuda"),
    "measure_memory_every": (
        int,
        "measure saved activations on steps 1, N+1, 2N+1, ... and the last (default 0: off, it hooks "
        "every saved tensor)",
    ),
    "profile_step": (
        int,
        "record step N with torch.profiler on every rank: run-dir/profile/rank<R>.json (Chrome/Perfetto "
        "trace) and rank<R>.txt (ops by self time); that step runs slower (default 0: off)",
    ),
}
_FIELD = {"warmup": "warmup_steps"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="model preset, model TOML, HF config.json or directory "
        "(default: the --config file's, else small)",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="run config with [model] (a table or a preset name), [train], [layout]",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("fp32", "bf16"),
        help="compute dtype; bf16 keeps fp32 master weights and reductions (default fp32)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile each transformer block (dp, fsdp, tp, pp; not with ep or cp)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to start (default 1; with --resume, the ranks the run was trained on)",
    )
    parser.add_argument("--run-dir", default=None, help="run directory (default runs/<model>-<time>)")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="STEP",
        help="continue the run in --run-dir from its latest checkpoint (or STEP)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--watchdog",
        type=float,
        default=180.0,
        metavar="SECONDS",
        help="--nproc N: stop the run, naming the stuck rank, when no rank moves on for this long "
        "(0: off; default 180)",
    )
    parser.add_argument(
        "--checkpoint-on-interrupt",
        action="store_true",
        help="on SIGINT/SIGTERM, save a checkpoint at the step boundary before stopping",
    )
    g = parser.add_argument_group("training")
    for name, (kind, text) in TRAIN_FLAGS.items():
        # the flag's value is None unless given, so a --config file's can stand; help names the default
        default = TrainSpec.__dataclass_fields__[_FIELD.get(name, name)].default
        shown = text if "default" in text else f"{text} (default {default})"
        g.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=shown)
    add_layout_arguments(parser)


def build_run_config(
    args: argparse.Namespace, keep_layout: bool = True, refill_dp: bool = False
) -> RunConfig:
    """The run's configuration from `--config`, `--model` and the flags (not yet resolved).
    `keep_layout=False`: the config file's [layout] is left out, the flags alone say the layout.
    `refill_dp`: the file is a run's own (resolved) config, resumed maybe on another world size: its
    dp fills what its other axes leave of the world, as if it had not been given."""
    model_entry, train_data, layout_data = (None, {}, {})
    if args.config:
        model_entry, train_data, layout_data = run_tables(args.config)
    if args.model:
        spec = load_model(args.model)
    elif isinstance(model_entry, dict):
        spec = _from_dict(ModelSpec, model_entry, f"{args.config} [model]").validate()
    else:
        spec = load_model(model_entry or "small")
    train = _from_dict(TrainSpec, dict(train_data), f"{args.config} [train]")
    for name in TRAIN_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            train = replace(train, **{_FIELD.get(name, name): value})
    if args.dtype:
        train = replace(train, dtype=args.dtype)
    if getattr(args, "compile", None):
        train = replace(train, compile=True)
    base = _from_dict(Layout, dict(layout_data), f"{args.config} [layout]") if keep_layout else None
    said = set(layout_data) - ({"dp", "fsdp"} if refill_dp else set())
    layout = layout_from_args(args, base, said if base else None)
    try:
        train = train.validate()
    except FivefoldError as exc:  # the message names the flag; a value read from the file is named there
        typed = {_FIELD.get(name, name) for name in TRAIN_FLAGS if getattr(args, name, None) is not None}
        flag_of = {field: flag for flag, field in _FIELD.items()}  # warmup_steps is --warmup
        named = f"{exc} "
        from_file = [
            k for k in train_data if k not in typed and f"--{flag_of.get(k, k).replace('_', '-')} " in named
        ]
        if not from_file:
            raise
        raise FivefoldError(f"{exc} (set by {from_file[0]} in {args.config} [train])") from None
    return RunConfig(model=spec, train=train, layout=layout)


def _say_layout_change(saved: Path, now: RunConfig, nproc: int) -> None:
    """One line on what a resume under new layout flags changes (rank 0 only under torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", nproc))
    old = RunConfig.from_toml(saved).layout  # as the run resolved it
    new = runtime_layout(now.layout, world, now.model, now.train.seq_len)  # bad flags: one error line
    changes = [
        f"{f.name} {getattr(old, f.name)} → {getattr(new, f.name)}"
        for f in fields(Layout)
        if getattr(old, f.name) != getattr(new, f.name)
    ]
    if int(os.environ.get("RANK", "0")) == 0:
        what = ", ".join(changes) if changes else "no change"
        print(f"fivefold train: resuming under the layout given: {what}", file=sys.stderr, flush=True)


def _saved_world(saved: Path) -> int:
    """The local ranks a resumed run continues on when --nproc is not given: as many as it was
    trained on (its saved layout's world), said on stderr where more than one."""
    world = RunConfig.from_toml(saved).layout.world
    if not 1 <= world <= MAX_LOCAL_RANKS:
        raise FivefoldError(
            f"--resume: {saved} says the run was trained on {world} ranks; give --nproc for this machine"
        )
    if world > 1:
        print(
            f"fivefold train: resuming on {world} local ranks, as the run was trained (--nproc to change)",
            file=sys.stderr,
            flush=True,
        )
    return world


def _check_saved_layout_fits(saved: Path, world: int) -> None:
    """A resume on another world keeps the run's layout but its dp: the other axes must divide the
    new world. Else one line saying how to continue (the checkpoint is resharded to a new layout)."""
    from fivefold.config.layout import AXES

    layout = RunConfig.from_toml(saved).layout
    kept = {a: getattr(layout, a) for a in AXES if a != "dp" and getattr(layout, a) > 1}
    product = math.prod(kept.values())
    if world % product:
        flags = " ".join(f"--{a} {v}" for a, v in kept.items())
        raise FivefoldError(
            f"--resume on {world} rank(s): the run was trained with {flags} ({layout.world} ranks), "
            f"and {product} does not divide {world}; resume with --nproc {layout.world} (or a multiple of "
            f"{product}), or give a layout for {world} rank(s) (e.g. "
            f"{' '.join(f'--{a} 1' for a in kept)}): the checkpoint is resharded to it"
        )


def _check_saved_batch_splits(saved: Path, cfg: RunConfig, world: int) -> None:
    """A resume on more data ranks keeps the run's global batch (the same optimisation), which must
    still split into whole micro-batches: else one line naming the run's batch and the ways on."""
    layout = runtime_layout(cfg.layout, world, cfg.model, cfg.train.seq_len)
    data, micro = layout.dp * layout.fsdp, cfg.train.micro_batch
    batch = cfg.train.step_batch(data)
    if batch % (micro * data) == 0:
        return
    fits = [m for m in range(micro, 0, -1) if batch % (m * data) == 0]
    keep = f"--micro-batch {fits[0]} keeps it" if fits else f"no micro-batch splits {batch} over {data}"
    raise FivefoldError(
        f"--resume on {world} rank(s): the run's global batch of {batch} sequences ({saved}) does not "
        f"split into micro-batches of {micro} over {data} data-parallel ranks; {keep}, or resume with "
        f"--nproc {RunConfig.from_toml(saved).layout.world} as the run was trained"
    )


def default_run_dir(model_name: str) -> Path:
    """runs/NAME-STAMP, the name reduced to a file name's plain characters: a model named
    "../x" or "/x" (or "org/model") stays under runs/."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    plain = re.sub(r"[^\w.-]+", "-", model_name).strip(".-") or "model"
    return Path("runs") / f"{plain}-{stamp}"


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def _launched() -> bool:
    """Inside a rank that torchrun (or our own launcher) started: all of its variables set, as whole
    numbers. Some of them, or one that is not a number, is a stale environment: one line, not a rank
    that cannot find its peers."""
    found = {name: os.environ[name] for name in TORCHRUN_VARIABLES if name in os.environ}
    if not found:
        return False
    if len(found) < len(TORCHRUN_VARIABLES) or not all(v.isdigit() for v in found.values()):
        said = ", ".join(f"{k}={v!r}" for k, v in found.items())
        raise FivefoldError(
            f"the environment sets {said}: a rank torchrun starts has {', '.join(TORCHRUN_VARIABLES)} "
            "all set to whole numbers; unset them to start the ranks with --nproc"
        )
    return True


def run(args: argparse.Namespace) -> int:
    typed_nproc = args.nproc is not None
    args.nproc = args.nproc if typed_nproc else 1
    if not 1 <= args.nproc <= MAX_LOCAL_RANKS:  # each is a process: a typo must not start thousands
        raise FivefoldError(f"--nproc must be in 1..{MAX_LOCAL_RANKS} local ranks, got {args.nproc}")
    cfg = build_run_config(args)
    if args.resume is not None and not args.run_dir:
        raise FivefoldError("--resume needs the --run-dir of the run to continue")
    if args.resume is not None and Path(args.run_dir).exists() and not Path(args.run_dir).is_dir():
        raise FivefoldError(f"--resume: --run-dir {args.run_dir} is a file, not a run directory")
    if args.resume is not None and args.config is None and args.model is None:
        saved = Path(args.run_dir) / "config.toml"
        # without the run's own model the default one would be built, and its checkpoint blamed
        if not saved.exists() or (saved.is_file() and run_tables(str(saved))[0] is None):
            what = "has no [model] table" if saved.exists() else "is missing"
            raise FivefoldError(
                f"--resume: {saved} {what}, and resuming builds the run's model from it; "
                "give the run's --model (or --config)"
            )
        if saved.exists():  # continue with the run's own settings; flags still override
            args.config = str(saved)
            # any layout flag means "this layout now": the saved one is not merged into it
            new_layout = any(getattr(args, f.name, None) is not None for f in fields(Layout))
            cfg = build_run_config(args, keep_layout=not new_layout, refill_dp=not new_layout)
            if not (typed_nproc or new_layout or _launched()):  # continue as the run was trained
                args.nproc = _saved_world(saved)
            elif not new_layout:
                _check_saved_layout_fits(saved, int(os.environ.get("WORLD_SIZE", args.nproc)))
                _check_saved_batch_splits(saved, cfg, int(os.environ.get("WORLD_SIZE", args.nproc)))
            if new_layout:
                _say_layout_change(saved, cfg, 1 if _launched() else args.nproc)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg.model.name)
    if not (math.isfinite(args.watchdog) and args.watchdog >= 0):
        raise FivefoldError(f"--watchdog must be a number of seconds >= 0 (0: off), got {args.watchdog}")
    job = TrainJob(
        cfg,
        run_dir,
        resume=args.resume,
        progress=not args.no_progress,
        watchdog=args.watchdog,
        checkpoint_on_interrupt=args.checkpoint_on_interrupt,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        known = _known_layout(cfg.layout, _world(args.nproc))
        say_idle_flags(args, known)
        _say_pipeline_micro_batch(args, cfg, known)
    return start(job, 1 if _launched() else args.nproc)


def _say_pipeline_micro_batch(args: argparse.Namespace, cfg: RunConfig, layout: Layout) -> None:
    """With a pipeline and a given --global-batch, each micro-batch is a data rank's batch over
    --microbatches: a --micro-batch of another size only has to divide that batch, and whoever typed it
    expected it to be the micro-batch."""
    if layout.pp == 1 or args.micro_batch is None or not args.global_batch or layout.dp <= 0:
        return
    data = layout.dp * layout.fsdp
    local = args.global_batch // data
    if args.global_batch % data or not layout.microbatches or local % layout.microbatches:
        return  # the preflight names the split that does not divide
    pipelined = local // layout.microbatches
    if pipelined != args.micro_batch:
        way = f": give --microbatches {local // args.micro_batch} for micro-batches of {args.micro_batch}"
        print(
            f"note: with pp {layout.pp}, a data rank's {local} sequences run as --microbatches "
            f"{layout.microbatches} of {pipelined}; --micro-batch {args.micro_batch} does not size them "
            f"(it only has to divide the {local})" + (way if local % args.micro_batch == 0 else ""),
            file=sys.stderr,
        )


def _world(nproc: int) -> int:
    """The ranks of this run: torchrun's world, or the `--nproc` local ranks train starts."""
    return int(os.environ.get("WORLD_SIZE", "1")) if _launched() else nproc


def _known_layout(layout: Layout, world: int) -> Layout:
    """`layout` with dp filled from `world` where it can be (what the notes on idle flags read); as it
    is where it cannot, which the preflight then names."""
    try:
        return layout.resolve(world)
    except FivefoldError:
        return layout


def start(job: TrainJob, nproc: int) -> int:
    """Train `job` here (one process, or one rank under torchrun) or on `nproc` local ranks."""
    world = _world(nproc)
    # an impossible layout, missing data or an occupied run directory: reported before any rank starts
    preflight(job.config, job.run_dir, job.resume, world)
    if job.config.train.compile:  # axes torch cannot compile with, refused before any rank starts
        check_compile(runtime_layout(job.config.layout, world, job.config.model, job.config.train.seq_len))
    if nproc > 1:
        return launch(nproc, job)
    if not _launched():
        try:
            return run_job(job)
        finally:  # an interrupted save leaves its .tmp: the one process that wrote it has stopped
            if run_dir_holder(job.run_dir) is None:  # not another run's save in progress
                remove_unfinished(job.run_dir)
    try:  # one rank under torchrun: its agent prints its own report, this rank says why in one line
        return run_job(job)
    except RuntimeError as exc:
        if not supervise.lost_peer(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"fivefold train: rank {os.environ.get('RANK', '?')} stopped: it lost a peer rank "
            f"(that rank or its launcher died): {first}",
            file=sys.stderr,
            flush=True,
        )
        return 1
