"""`fivefold plan --validate / --cross-validate / --calibrate`: the planner against published runs
(reference-runs TOML files) or `fivefold train` run directories."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fivefold.errors import FivefoldError
from fivefold.outputs import check_not_an_input, is_stream, write_text_whole


def _runs(paths: list[str]) -> tuple[list, list[str]]:
    """Cases of the files (the bundled reference sets when none is given) and the runs left out."""
    from fivefold.plan import validation as V
    from fivefold.plan.runs import (
        COMPARED_KINDS,
        THROUGHPUT_KEYS,
        builtin_paths,
        contradictions,
        load_runs,
        run_from_dir,
        throughput,
        unread_keys,
    )

    files = [Path(p) for p in paths] or builtin_paths()
    runs = [run_from_dir(p) for p in files if p.is_dir()]
    runs += load_runs(*[p for p in files if not p.is_dir()]) if any(not p.is_dir() for p in files) else []
    seen: set[str] = set()
    for run in runs:  # a run directory given twice (or named as a file's run) would count twice
        if run["id"] in seen:
            raise FivefoldError(f"run id {run['id']!r} is given twice; ids must be unique")
        seen.add(run["id"])
    left_out, kept = [], []
    for run in runs:
        if paths:  # a user's file: a key under a name the reader does not take would be planned without
            for line in unread_keys(run):
                print(f"note: {line}", file=sys.stderr)
        bad = contradictions(run)
        if bad:
            left_out.append(f"run {run['id']}: left out, its facts contradict: {'; '.join(bad)}")
        elif paths and run.get("kind") not in COMPARED_KINDS:  # the bundled sets' analytic runs: not news
            left_out.append(
                f"run {run['id']}: left out, its kind {run.get('kind')!r} is no measurement "
                f"(the runs compared are of kind {' or '.join(map(repr, COMPARED_KINDS))}, the default)"
            )
        elif paths and "layers" not in run["model"]:
            left_out.append(
                f"run {run['id']}: left out, its [model] table states no shape (layers, hidden, heads)"
            )
        elif throughput(run) is None and run.get("kind") in (COMPARED_KINDS if paths else ("measured",)):
            left_out.append(
                f"run {run['id']}: left out, its [measured] table states no throughput "
                f"(one of {', '.join(THROUGHPUT_KEYS)})"
            )
        else:
            kept.append(run)
    return V.cases(kept), left_out


def run_runs(args: argparse.Namespace) -> int:
    from fivefold.plan import validation as V

    cross = args.cross_validate is not None
    paths = args.cross_validate if cross else args.validate
    given = getattr(args, "hardware", None)
    if given is not None and (args.calibrate is not None or cross or not paths):
        raise FivefoldError(
            "--hardware applies to --validate with your own runs files or run directories; "
            "--calibrate, --cross-validate and the bundled sets plan each run on the GPU it names"
        )
    plot = getattr(args, "plot", None)
    if plot is not None and args.calibrate is not None:
        raise FivefoldError(
            f"--plot draws --validate's or --cross-validate's predictions, not --calibrate's "
            f"(got --plot {plot})"
        )
    if plot is not None and not plot.endswith(".svg") and not is_stream(plot):
        raise FivefoldError(f"--plot writes an SVG: give a FILE.svg (got --plot {plot})")
    if args.calibrate is not None:
        return _calibrate(args)
    cases, left_out = _runs(paths)
    for line in left_out:  # before the error below, which they explain when they are every run
        print(line, file=sys.stderr)
    if not cases:
        if left_out:
            n = len(left_out)
            raise FivefoldError(f"no run left to compare: the {n} given were each left out (above)")
        raise FivefoldError("no run with a model shape and a published throughput to compare")
    sources = {c.source for c in cases}
    if cross and len(sources) < 2:  # leaving the one source out would leave nothing to fit on
        raise FivefoldError(
            f"--cross-validate leaves one source out at a time and fits on the rest, so it needs runs "
            f"from at least 2 sources; these runs have {len(sources)} ({', '.join(sorted(sources))}); "
            "use --validate for them"
        )
    if not cross and paths:  # someone's own runs: predicted as the planner ships, nothing refitted
        title = "as shipped (preset knobs; the constant is the bundled runs' median MFU)"
        if given is not None:  # e.g. the file `--calibrate` wrote: does it predict the other runs?
            from fivefold.config import load_hardware

            hw = load_hardware(given)
            _say_other_gpus(cases, hw, given)
            cases = V.on_hardware(cases, hw)
            title = f"on --hardware {given} (the constant is the bundled runs' median MFU)"
        shipped = V.as_shipped(cases, _runs([])[0])
        _plot(args, shipped, f"{paths[0] if len(paths) == 1 else 'your runs'}: {title.split(' (')[0]}")
        memory = [(c.id, *row) for c in cases for row in V.rank0_memory(c)]
        if args.json:
            rows = [
                {"run": r, "part": part, "measured": got, "planned": int(want)}
                for r, part, got, want in memory
            ]
            _print_json({"as_shipped": shipped.to_json(), **({"memory": rows} if rows else {})}, left_out)
            return 0
        print(V.per_run_table(shipped))
        print(V.source_table(shipped, title))
        if memory:
            print()
            print(_memory_table(memory))
        return 0
    inside = V.in_sample(cases)
    loso = V.cross_validate(cases) if cross else None
    if loso is not None:
        _plot(args, loso, "leave-one-source-out: knobs fitted without each run's source")
    else:
        _plot(args, inside, "in-sample: knobs fitted on every run")
    if args.json:
        out = {"in_sample": inside.to_json()}
        if loso is not None:
            out["leave_one_source_out"] = loso.to_json()
        _print_json(out, left_out)
        return 0
    print(V.per_run_table(inside) if not cross else "")
    print(V.source_table(inside, "in-sample (knobs fitted on every run)"))
    print(V.knobs_table(inside))
    if loso is not None:
        print()
        print(V.per_run_table(loso))
        print(V.source_table(loso, "leave-one-source-out (knobs fitted without the source)"))
        print(V.knobs_table(loso))
    return 0


def _memory_table(rows: list[tuple[str, str, int, float]]) -> str:
    """Rank 0's measured memory of run directories against the plan, a line per part."""
    width = max(len("run"), *(len(r[0]) for r in rows)) + 2
    lines = [
        "rank 0's memory, measured by the run against the plan of its stage (bytes)",
        f"{'run':<{width}}{'part':<13}{'measured':>15}{'planned':>15}{'diff':>9}",
    ]
    for run, part, got, want in rows:
        diff = f"{want / got - 1:+.1%}" if got else "-"
        lines.append(f"{run:<{width}}{part:<13}{got:>15,}{int(want):>15,}{diff:>9}")
    return "\n".join(lines)


def _plot(args: argparse.Namespace, validation, title: str) -> None:  # noqa: ANN001 - Validation
    """--plot: the predictions against the published runs as an SVG (fivefold.plan.figure)."""
    if getattr(args, "plot", None) is None:
        return
    from fivefold.plan.figure import validation_svg

    write_text_whole(Path(args.plot), validation_svg(validation, title), flag="--plot")
    print(f"wrote {args.plot}", file=sys.stderr)


def _print_json(out: dict, left_out: list[str]) -> None:
    import json

    print(json.dumps({**out, "left_out": left_out}))


def _dispatch_share(cases: list, hw) -> float:  # noqa: ANN001 - validation cases and a HardwareSpec
    """The share of the cases' planned step time that is the blocks' host dispatch (a CPU device's
    `block_dispatch_us`), which a calibration takes as given."""
    import dataclasses

    from fivefold.plan import plan

    if not hw.block_dispatch_us or hw.comm_overlap:
        return 0.0
    total = without = 0.0
    for c in cases:
        own = dataclasses.replace(hw, threads_per_rank=c.inputs.hw.threads_per_rank)
        inp = c.inputs
        total += plan(inp.model, own, inp.layout, inp.shape).step_time_s
        bare = dataclasses.replace(own, block_dispatch_us=0.0)
        without += plan(inp.model, bare, inp.layout, inp.shape).step_time_s
    return 1 - without / total if total else 0.0


# a fit that still misses the runs by more than CALIBRATION_MISS on average (tenfold) explains none of
# them: the knobs ran to the ends of their physical ranges (a step time of 1e6 s, a model shape not the
# run's), and a hardware file of such knobs would plan nothing right. Past CALIBRATION_WARN the file is
# written, and said to plan these runs that far off: a slow real cluster (a congested network, a
# starved input pipeline) is slower than the device's ranges allow, for reasons no knob here holds
CALIBRATION_MISS = 10.0
CALIBRATION_WARN = 0.5


def _say_other_gpus(cases: list, hw, given: str) -> None:
    """--hardware plans every run on one device: name the runs that state another (a calibration of
    one GPU read against runs of another plans them that far off, without a word otherwise)."""
    other = [
        c
        for c in cases
        if abs(c.inputs.hw.peak_tflops / hw.peak_tflops - 1) > 0.01
        or abs(c.inputs.hw.gpu_memory_gb - hw.gpu_memory_gb) > 0.5
    ]
    if other:
        named = ", ".join(f"{c.id} ({c.inputs.hw.name})" for c in other[:5])
        more = f" and {len(other) - 5} more" if len(other) > 5 else ""
        print(
            f"note: --hardware {given} ({hw.peak_tflops:g} TFLOP/s, {hw.gpu_memory_gb:g} GB) plans every run "
            f"on it; {len(other)} state another GPU: {named}{more}",
            file=sys.stderr,
        )


def _node_size(cases: list) -> int:
    """GPUs per node of the device a calibration writes. Each run of a machine's run directories
    states its own world as its node (all its ranks on one host), so the first run's would make a
    later, wider run on that machine cross nodes: take the widest, and on a CPU device no fewer than
    its preset's ranks a node (published runs of one cluster all state its node)."""
    from fivefold.config import load_hardware

    widest = max(c.inputs.hw.gpus_per_node for c in cases)
    hw = cases[0].inputs.hw
    if hw.comm_overlap:
        return widest
    try:
        return max(widest, load_hardware(hw.name).gpus_per_node)
    except FivefoldError:  # a calibrated file's device, named by no preset
        return widest


def _calibrate(args: argparse.Namespace) -> int:
    import dataclasses

    from fivefold.config import dumps_toml, to_dict
    from fivefold.plan import validation as V

    if args.out:  # refused before the fit: the runs files, and the files of a run directory it reads
        read: list[Path] = []
        for path in map(Path, args.calibrate):
            files = ("config.toml", "metrics.jsonl", "run.json")
            read += [path / name for name in files] if path.is_dir() else [path]
        check_not_an_input(args.out, read)
    cases, left_out = _runs(args.calibrate)
    for line in left_out:
        print(line, file=sys.stderr)
    if not cases:
        raise FivefoldError("--calibrate: no run with a model shape and a published throughput to fit")
    names = {c.inputs.hw.name for c in cases}
    if len(names) > 1:
        raise FivefoldError(
            f"--calibrate: the runs are on different GPUs ({', '.join(sorted(names))}); give runs of one GPU"
        )
    # a calibration starts from, and is pulled toward, the device's own figures (`V.anchored`)
    knobs = V.fit(cases, start=V.anchored(cases[0].inputs.hw))
    hw = dataclasses.replace(knobs.apply(cases[0].inputs.hw), gpus_per_node=_node_size(cases))
    result = V.in_sample(cases, knobs)
    s = result.summary()
    if s["mean"] > CALIBRATION_MISS:
        worst = max(result.predictions, key=lambda p: abs(p.error))
        raise FivefoldError(
            f"--calibrate: no knobs within their physical ranges come near these runs (mean |error| "
            f"{s['mean']:.0%} at the fit); run {worst.run} states {worst.metric} {worst.published:.4g}, the "
            f"fitted device plans {worst.predicted:.4g}: check its step time and model shape. Nothing written"
        )
    if s["mean"] > CALIBRATION_WARN:
        print(
            f"note: the fitted knobs reach the ends of their physical ranges and still miss these runs by "
            f"{s['mean']:.0%} on average: the runs are slower than this device explains (its network, host "
            "or input pipeline), and the file plans them that far off",
            file=sys.stderr,
        )
    # the file names the device; the threads are each run's own, not the device's
    data = {k: v for k, v in to_dict(dataclasses.replace(hw, threads_per_rank=0.0)).items() if k != "name"}
    text = (
        f"# fitted by `fivefold plan --calibrate` to {s['runs']} run(s): mean |error| {s['mean']:.1%}, "
        f"worst {s['worst']:.1%}\n" + dumps_toml(data)
    )
    if len(cases) == 1 and max(cases[0].inputs.layout.tp, cases[0].inputs.layout.cp) > 1:
        print(
            "note: one run with tp or cp fixes one number, its step: how much of it is compute and how much"
            " the collectives' cost cannot be told apart. Calibrate on a data-parallel run as well to plan"
            " other layouts on this machine",
            file=sys.stderr,
        )
    threads = {c.inputs.hw.threads_per_rank for c in cases}
    # a CPU: the rate per core is fitted at one count (0: the runs did not record theirs)
    if not hw.comm_overlap and len(threads) == 1 and min(threads) > 0:
        (count,) = threads
        print(
            f"note: every run here ran {count:g} thread(s) a rank; a plan of another thread count scales "
            "the fitted rate by its cores, which a CPU's small ops do not reach (on a 2-core machine, "
            "`small` ran 1.56x faster on 2 threads, not the 1.87x planned). Calibrate on runs with the "
            "thread count you will plan",
            file=sys.stderr,
        )
    dispatch = _dispatch_share(cases, hw)
    if dispatch > 0.5:
        print(
            f"note: {dispatch:.0%} of these runs' planned steps is the host's per-op work (a CPU's eager "
            "dispatch), which no knob here fits: their compute is too small to calibrate its rates. "
            "Calibrate on a larger model's run as well",
            file=sys.stderr,
        )
    if args.out:
        write_text_whole(Path(args.out), text)
    if args.json:  # the fitted hardware and how well it fits, whether or not a file was written
        _print_json({"hardware": data, "fit": s, "runs": result.to_json()["runs"], "out": args.out}, left_out)
    elif args.out:
        print(f"wrote {args.out} (mean |error| {s['mean']:.1%} over {s['runs']} run(s))")
    else:
        print(text)
    return 0
