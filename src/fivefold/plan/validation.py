"""Predicted vs published, in-sample and leave-one-source-out (LOSO).

Every run of a `fivefold-reference-runs` file is planned with its published model, hardware and
layout (`plan/runs.py` fills the unpublished fields). Its published throughput (tokens/s, step time,
TFLOP/s or MFU, whichever is the least convention-bound) is compared with the prediction as a
relative throughput error, which equals the relative MFU error.

The planner's free knobs (`Knobs`: the large-GEMM efficiency per GPU generation and the fp8 speed-up)
are fitted by minimising the mean |log(predicted/published)|. LOSO fits them without one source's
runs and predicts that source; the median-constant predictor (every run at the median published MFU
of the other sources) is scored the same way, so that the two numbers can be compared.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fivefold.config import HardwareSpec, Layout
from fivefold.errors import FivefoldError
from fivefold.plan.memory import model_state
from fivefold.plan.report import plan
from fivefold.plan.result import Plan, capacity
from fivefold.plan.runs import (
    COMPARED_KINDS,
    RunInputs,
    Throughput,
    build,
    counts_causal_half,
    family,
    optimizer_bytes,
    source_of,
    source_peak,
    throughput,
)
from fivefold.plan.runs import load_runs as _load_runs
from fivefold.plan.search import RECOMPUTE_ORDER, lightest_recompute
from fivefold.plan.spec import TrainShape, resolve_arch

GIB = 2**30
# an unpublished choice is filled with the trainer's default unless another is this much faster
# (authors tune away a 30% pipeline bubble, not a 4% one)
WORTH_TUNING = 0.10


# --------------------------------------------------------------------------------------------
# knobs


@dataclass(frozen=True)
class Knobs:
    """The fitted hardware knobs; None leaves the preset's value."""

    matmul_a100: float | None = None
    matmul_hopper: float | None = None
    matmul_other: float | None = None  # any other GPU (B200, a CPU): one spec per calibration
    attention_a100: float | None = None
    attention_hopper: float | None = None
    attention_other: float | None = None
    memory_other: float | None = None  # streaming share of HBM/DRAM bandwidth, other devices only
    latency_other: float | None = None  # µs per step of a collective inside a node, other devices only
    fp8_speedup: float | None = None
    step_overhead: float | None = None  # seconds per step, every device

    def apply(self, hw: HardwareSpec) -> HardwareSpec:
        changes: dict[str, float] = {}
        mm = {"a100": self.matmul_a100, "hopper": self.matmul_hopper, "other": self.matmul_other}[family(hw)]
        if mm is not None:
            changes["matmul_efficiency"] = mm
        if family(hw) == "other" and self.memory_other is not None:
            changes["memory_efficiency"] = self.memory_other
        if family(hw) == "other" and self.latency_other is not None:
            changes["intra_node_latency_us"] = self.latency_other
        attn = {"a100": self.attention_a100, "hopper": self.attention_hopper, "other": self.attention_other}[
            family(hw)
        ]
        if attn is not None:
            changes["attention_efficiency"] = attn
        if self.fp8_speedup is not None:
            changes["fp8_speedup"] = self.fp8_speedup
        if self.step_overhead is not None:
            changes["step_overhead_s"] = self.step_overhead
        return dataclasses.replace(hw, **changes) if changes else hw

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


KNOB_RANGES = {
    "matmul_a100": (0.4, 1.0),
    "matmul_hopper": (0.3, 1.0),
    "matmul_other": (0.001, 1.0),
    "attention_a100": (0.2, 0.9),
    "attention_hopper": (0.15, 0.9),
    "attention_other": (0.001, 0.9),
    "memory_other": (0.001, 1.0),
    "latency_other": (1.0, 1e5),
    "fp8_speedup": (1.0, 2.0),
    "step_overhead": (0.001, 1.0),
}


# --------------------------------------------------------------------------------------------
# one run


@dataclass
class Prediction:
    run: str
    source: str
    metric: str
    published: float
    predicted: float
    mfu: float  # predicted MFU (model FLOPs, full attention square, the planner's 16-bit peak)
    fits: bool
    margin_gb: float  # capacity - planned memory (negative: does not fit)
    recompute: str
    uncertain: bool = False  # the run carries an `uncertain` note (derived shapes, unstated peak, ...)
    filled: str = ""  # what the planner chose for the facts the run does not publish (`filled`)

    @property
    def ratio(self) -> float:
        """Predicted over published throughput."""
        if self.metric == "step time s":
            return self.published / self.predicted
        return self.predicted / self.published

    @property
    def error(self) -> float:
        return self.ratio - 1.0

    @property
    def published_mfu(self) -> float:
        """The published throughput as an MFU on the planner's FLOP convention and peak."""
        return self.mfu / self.ratio


@dataclass
class Case:
    """A run with a throughput to predict, built once (knob changes only swap the hardware)."""

    run: dict[str, Any]
    inputs: RunInputs
    target: Throughput

    @property
    def id(self) -> str:
        return str(self.run["id"])

    @property
    def source(self) -> str:
        return source_of(self.run)


def cases(runs: Iterable[dict[str, Any]], skipped: list[str] | None = None) -> list[Case]:
    """Measured runs with a model shape and a published throughput; the rest go to `skipped`."""
    out = []
    for run in runs:
        if run.get("kind", "measured") not in COMPARED_KINDS:
            continue
        target = throughput(run)
        try:
            inputs = build(run)
        except FivefoldError as exc:
            if skipped is None:
                raise
            skipped.append(str(exc))
            continue
        if inputs is None or target is None:
            continue
        out.append(Case(run, fill(inputs, START.apply(inputs.hw)), target))
    return out


def _plan_case(case: Case, hw: HardwareSpec) -> Plan:
    inp = case.inputs
    return plan(inp.model, hw, inp.layout, inp.shape)


def _variants(inp: RunInputs) -> list[tuple[Layout, TrainShape]]:
    """Every way to fill what the run leaves unpublished (micro-batch, and with it the global batch when
    only the accumulation count is published; pipeline schedule or its chunk count; ZeRO stage)."""
    lay, shape = inp.layout, inp.shape
    local = shape.global_batch // (lay.dp * lay.fsdp)
    if "global_batch" in inp.free:  # only the accumulation count is published: the batch follows
        mbs = [1, 2, 4, 8, 16, 32]
    elif "micro_batch" in inp.free:  # powers of two, and the whole local batch in one micro-batch
        mbs = sorted(
            {b for b in (1, 2, 4, 8, 16, 32) if local % b == 0} | ({local} if local <= 64 else set())
        )
    else:
        mbs = [shape.micro_batch]
    accumulation = local // shape.micro_batch
    schedules = [(lay.pp_schedule, lay.virtual_stages)]
    if "pipeline_schedule" in inp.free:
        chunks = [v for v in range(2, 9) if inp.model.layers >= lay.pp * v] if inp.interleaved else []
        schedules = [("1f1b", 1)] + [("interleaved-1f1b", v) for v in chunks]
    elif "virtual_stages" in inp.free:  # every chunk count up to 8 that leaves a layer a chunk
        per_rank = inp.model.layers // lay.pp
        schedules = [("interleaved-1f1b", v) for v in range(2, min(per_rank, 8) + 1)]
    layouts = [lay]
    if "zero_stage" in inp.free:  # ZeRO-2 over the data ranks is fsdp at zero 2 in fivefold's words
        layouts.append(dataclasses.replace(lay, dp=1, fsdp=lay.dp, zero=2))
    out = []
    for base in layouts:
        for sched, v in schedules:
            for mb in mbs:
                batch = shape.global_batch
                if "global_batch" in inp.free:
                    batch = mb * accumulation * lay.dp * lay.fsdp
                out.append(
                    (
                        dataclasses.replace(base, pp_schedule=sched, virtual_stages=v),
                        dataclasses.replace(shape, micro_batch=mb, global_batch=batch),
                    )
                )
    return out


def fill(inp: RunInputs, hw: HardwareSpec) -> RunInputs:
    """The run with its unpublished facts chosen as its authors would have: among the variants that
    fit, the fastest, with the least recompute, and host offload (optimizer, then checkpoints) only
    when nothing else fits (the run did run). Chosen once, on the unfitted START knobs, so no fitted
    value steers it."""
    unstated = tuple(rc for rc in RECOMPUTE_ORDER if rc != "selective" or inp.selective)
    recomputes = (inp.layout.recompute,) if inp.recompute_known else unstated
    # a stated full recompute is full on the blocks the run says (all unless it names a count)
    lightest = (lambda lay, fits: lay if fits(lay) else None) if inp.recompute_known else None
    # (optimizer, checkpoints) on the host: as published, or, unpublished, tried in this order
    stated = (inp.shape.offload_optimizer, inp.shape.offload_checkpoints)
    offloads = [stated] if inp.offload_known else [(False, False), (True, False), (True, True)]
    variants = _variants(inp)
    best: tuple[float, Layout, TrainShape] | None = None
    default: tuple[float, Layout, TrainShape] | None = None  # the first variant: 1F1B, the least micro-batch
    fallback: tuple[float, Layout, TrainShape] | None = None
    for offload in offloads:
        for lay, shape in variants:
            shape = dataclasses.replace(shape, offload_optimizer=offload[0], offload_checkpoints=offload[1])
            plans: dict[tuple[str, int], Plan] = {}

            def fits(trial: Layout, shape: TrainShape = shape, plans: dict = plans) -> bool:
                p = plans[(trial.recompute, trial.recompute_layers)] = plan(inp.model, hw, trial, shape)
                return p.fits

            try:  # the least recompute that fits is also the fastest
                if lightest is not None:
                    chosen = lightest(lay, fits)
                else:
                    chosen = lightest_recompute(lay, inp.model, fits, recomputes, inp.shape.seq_len)
            except FivefoldError:
                continue  # this schedule or micro-batch cannot run this model
            if chosen is None:  # by how much the heaviest recompute, the last tried, misses
                p = list(plans.values())[-1]
                trial = dataclasses.replace(
                    lay, recompute=p.layout.recompute, recompute_layers=p.layout.recompute_layers
                )
                if fallback is None or p.margin_bytes > fallback[0]:
                    fallback = (p.margin_bytes, trial, shape)
                continue
            p = plans[(chosen.recompute, chosen.recompute_layers)]
            if best is None or p.tokens_per_s > best[0]:
                best = (p.tokens_per_s, chosen, shape)
            if lay is variants[0][0] and shape.micro_batch == variants[0][1].micro_batch and not any(offload):
                default = (p.tokens_per_s, chosen, shape)
        if best is not None:
            break
    chosen = best or fallback
    if best is not None and default is not None and best[0] < default[0] * (1 + WORTH_TUNING):
        chosen = default  # what the trainer does untold, unless its authors had much to gain
    if chosen is None:
        return inp
    return dataclasses.replace(inp, layout=chosen[1], shape=chosen[2])


def predict(case: Case, knobs: Knobs = Knobs()) -> Prediction:
    hw = knobs.apply(case.inputs.hw)
    p = _plan_case(case, hw)
    metric = case.target.metric
    mfu = p.mfu_causal if counts_causal_half(case.run) else p.mfu
    if metric == "tokens/s/GPU":
        value = p.tokens_per_s / p.gpus
    elif metric == "step time s":
        value = p.step_time_s
    elif metric == "TFLOP/s (hardware)":
        value = p.hardware_tflops_per_gpu
    elif metric.startswith("TFLOP/s"):
        value = mfu * hw.peak_tflops
    elif metric == "HFU":  # hardware FLOPs over the source's peak
        value = p.hardware_tflops_per_gpu / source_peak(case.run, hw, case.inputs.shape.fp8)
    else:  # MFU of the source's peak
        value = mfu * hw.peak_tflops / source_peak(case.run, hw, case.inputs.shape.fp8)
    margin = (capacity(hw) - p.memory.total) / 1e9
    return Prediction(
        case.id,
        case.source,
        metric,
        case.target.value,
        value,
        p.mfu,
        p.fits,
        margin,
        p.layout.recompute,
        "uncertain" in case.run,
        filled(case.inputs),
    )


def filled(inp: RunInputs) -> str:
    """The choices `fill` made for what a run leaves unpublished, in flag-like words ("" if none)."""
    lay, shape, free = inp.layout, inp.shape, set(inp.free)
    out = []
    if not inp.recompute_known:
        n = lay.recompute_layers
        blocks = f" ({n} block{'s' if n > 1 else ''} a chunk)" if lay.recompute == "full" and n else ""
        out.append(f"recompute {lay.recompute}{blocks}")
    if free & {"micro_batch", "global_batch"}:
        out.append(f"micro-batch {shape.micro_batch}")
    if "global_batch" in free:
        out.append(f"batch {shape.global_batch}")
    if free & {"pipeline_schedule", "virtual_stages"} and lay.pp > 1:
        chunks = f" ×{lay.virtual_stages}" if lay.virtual_stages > 1 else ""
        out.append(f"{lay.pp_schedule}{chunks}")
    if "zero_stage" in free:
        out.append(f"zero {lay.zero}" + (" over fsdp" if lay.fsdp > 1 and lay.dp == 1 else ""))
    if not inp.offload_known:
        host = [
            n
            for n, on in (("optimizer", shape.offload_optimizer), ("checkpoints", shape.offload_checkpoints))
            if on
        ]
        if host:
            out.append(" and ".join(host) + " on the host")
    return ", ".join(out)


# --------------------------------------------------------------------------------------------
# fitting and cross-validation


def percent(x: float, width: int, sign: str = "") -> str:
    """`x` as a percentage right-aligned in `width`: one decimal, or three digits in powers of ten
    where it would not fit a column (a rate a unit slip put 10^300 times off)."""
    text = f"{x:{sign}.1%}" if abs(x) < 100 else f"{100 * x:{sign}.2e}%"
    return f"{text:>{width}}"


def loss(preds: list[Prediction]) -> float:
    return sum(abs(math.log(p.ratio)) for p in preds) / max(len(preds), 1)


# Where the fit starts (mid-range physical values), so that its result does not depend on the presets
START = Knobs(
    matmul_a100=0.7,
    matmul_hopper=0.6,
    matmul_other=0.5,
    attention_a100=0.4,
    attention_hopper=0.3,
    attention_other=0.3,
    memory_other=0.7,
    latency_other=100.0,
    fp8_speedup=1.5,
    step_overhead=0.05,
)


# Each knob is pulled toward its mid-range START value by this much mean |log error| per e-fold it moves
# away: a knob the runs determine (a matmul rate) does not notice it, one they hardly determine stays
# near its physical middle instead of running to the end of its range. Left out, MosaicML's short
# steps are the only ones that show the per-step overhead, and without the pull the others fit it at
# its floor, 1 ms; the fp8 speed-up likewise without NeMo's fp8 rows (leave-one-source-out mean
# 11.98% -> 11.02%; 0.003 gives 11.20%, 0.02 10.81%, 0.05 11.24%)
PRIOR_WEIGHT = 0.01


def anchored(hw: HardwareSpec) -> Knobs:
    """START with the hardware's own values where its spec has them: what a calibration of that device
    starts from and is pulled toward (a preset's figures were measured on such a device; START's are
    the middle of every GPU's range)."""
    from fivefold.plan.compute import DEFAULT_STEP_OVERHEAD_S, Efficiencies

    fam = family(hw)
    eff = Efficiencies.of(hw)  # the values its plans use unfitted
    own = {
        f"matmul_{fam}": eff.matmul,
        f"attention_{fam}": eff.attention,
        "fp8_speedup": eff.fp8_speedup,
        "step_overhead": hw.step_overhead_s or DEFAULT_STEP_OVERHEAD_S,
    }
    if fam == "other":
        own |= {"memory_other": eff.memory, "latency_other": hw.intra_node_latency_us}
    lo_hi = {k: KNOB_RANGES[k] for k in own}
    kept = {k: v for k, v in own.items() if v and lo_hi[k][0] <= v <= lo_hi[k][1]}
    return dataclasses.replace(START, **kept)


def fit(train: list[Case], start: Knobs = START, rounds: int = 1) -> Knobs:
    """Coordinate descent, golden-section per knob in its physical range, each pulled toward `start`
    (`PRIOR_WEIGHT`); knobs no training run depends on (no A100 run, no fp8 run) keep their preset
    value. Runs marked `uncertain` (derived shapes, unstated peak or network) are predicted but do not
    steer the fit."""
    train = [c for c in train if "uncertain" not in c.run] or train
    needed = {name: any(_depends(c, name) for c in train) for name in KNOB_RANGES}
    knobs = Knobs(**{k: v for k, v in start.to_dict().items() if needed.get(k)})
    for _ in range(rounds):
        for name, (lo, hi) in KNOB_RANGES.items():
            if not needed[name]:
                continue
            subset = [c for c in train if _depends(c, name)]

            def f(x: float, name: str = name, subset: list[Case] = subset, base: Knobs = knobs) -> float:
                k = dataclasses.replace(base, **{name: x})
                prior = PRIOR_WEIGHT * abs(math.log(x / getattr(start, name)))
                return loss([predict(c, k) for c in subset]) + prior

            best = math.exp(_golden(lambda u, f=f: f(math.exp(u)), math.log(lo), math.log(hi)))
            knobs = dataclasses.replace(knobs, **{name: float(f"{best:.3g}")})
    return knobs


def _depends(case: Case, name: str) -> bool:
    if name == "fp8_speedup":
        return case.inputs.shape.fp8
    if name == "step_overhead":  # the synchronisation of several ranks; one GPU has none
        return case.inputs.layout.world > 1
    if name == "latency_other":  # only runs with per-layer collectives inside the node show it
        lay = case.inputs.layout
        return family(case.inputs.hw) == "other" and max(lay.tp, lay.cp, lay.ep) > 1
    return family(case.inputs.hw) == name.split("_")[1]


def _golden(f: Callable[[float], float], lo: float, hi: float, tol: float = 0.015) -> float:
    """Minimum of a unimodal f on [lo, hi] (the knobs are searched in log space: 1.5% steps)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


@dataclass
class Validation:
    """Predictions of every case (in-sample or LOSO) with the median-constant's errors beside."""

    predictions: list[Prediction]
    constant_errors: dict[str, float]  # run id -> error of the median-constant predictor
    knobs: dict[str, Knobs] = field(default_factory=dict)  # source left out -> knobs ("all": in-sample)
    skipped: list[str] = field(default_factory=list)

    def by_source(self) -> dict[str, list[Prediction]]:
        out: dict[str, list[Prediction]] = {}
        for p in self.predictions:
            out.setdefault(p.source, []).append(p)
        return out

    def certain(self) -> list[Prediction]:
        return [p for p in self.predictions if not p.uncertain]

    def summary(self, preds: list[Prediction] | None = None) -> dict[str, float]:
        preds = self.predictions if preds is None else preds
        errs = [abs(p.error) for p in preds]
        const = [abs(self.constant_errors[p.run]) for p in preds]
        return {
            "runs": len(preds),
            "mean": statistics.fmean(errs) if errs else 0.0,
            "worst": max(errs, default=0.0),
            "constant_mean": statistics.fmean(const) if const else 0.0,
            "constant_worst": max(const, default=0.0),
            "not_fitting": sum(not p.fits for p in preds),
        }

    def to_json(self) -> dict[str, Any]:
        """Every prediction with the constant's error beside it, the summaries per source and over
        all runs (and over the runs without an `uncertain` note), and the knobs each fit used."""
        runs = [
            {**dataclasses.asdict(p), "error": p.error, "constant_error": self.constant_errors[p.run]}
            for p in self.predictions
        ]
        return {
            "runs": runs,
            "sources": {source: self.summary(preds) for source, preds in self.by_source().items()},
            "all": self.summary(),
            "all_certain": self.summary(self.certain()),
            "knobs": {source: k.to_dict() for source, k in self.knobs.items()},
        }


def in_sample(all_cases: list[Case], knobs: Knobs | None = None) -> Validation:
    """Knobs fitted on every case (or the given ones), every case predicted with them."""
    knobs = fit(all_cases) if knobs is None else knobs
    preds = [predict(c, knobs) for c in all_cases]
    median = statistics.median(p.published_mfu for p in preds)
    const = {p.run: median / p.published_mfu - 1 for p in preds}
    return Validation(preds, const, {"all": knobs})


def rank0_memory(case: Case) -> list[tuple[str, int, float]]:
    """(part, measured, planned) bytes of rank 0 for a run directory that measured them: its weights,
    gradients and optimizer state, and the peak of its saved activations where the run measured them
    (`--measure-memory-every`), against the layout plan of rank 0's stage."""
    from fivefold.plan.memory import stage_memory, stage_names, stage_rank

    measured = case.run.get("measured", {}).get("rank0_memory_bytes") or {}
    if not measured:
        return []
    inp = case.inputs
    shape = inp.shape.on(inp.hw)
    arch = resolve_arch(inp.model, shape.block, shape.attention, shape.expert_tp)
    which = next(
        w for w in stage_names(inp.layout, inp.model, shape.seq_len) if stage_rank(w, inp.layout.pp) == 0
    )
    mem = stage_memory(inp.model, arch, inp.layout, shape, shape.microbatches(inp.layout), which)
    return [(part, measured[part], float(getattr(mem, part))) for part in measured]


def run_dir_memory(path: str | Path) -> list[tuple[str, int, float]]:
    """`rank0_memory` of one fivefold run directory (none where its metrics measured no memory)."""
    from fivefold.plan.runs import run_from_dir

    found = cases([run_from_dir(path)])
    return rank0_memory(found[0]) if found else []


def on_hardware(cases: list[Case], hw: HardwareSpec) -> list[Case]:
    """The cases planned on `hw` (a calibrated file, say) instead of the GPU each names; a CPU run
    keeps the threads it ran with, where `hw` does not say."""

    def threads(c: Case) -> HardwareSpec:
        if hw.threads_per_rank or not c.inputs.hw.threads_per_rank:
            return hw
        return dataclasses.replace(hw, threads_per_rank=c.inputs.hw.threads_per_rank)

    return [dataclasses.replace(c, inputs=dataclasses.replace(c.inputs, hw=threads(c))) for c in cases]


def as_shipped(all_cases: list[Case], reference: list[Case] | None = None) -> Validation:
    """Every case predicted with the knobs fivefold ships (the hardware presets, fitted to the
    bundled runs), nothing refitted to the cases themselves; the constant predictor is the median
    published MFU of `reference` (the bundled runs), so neither side has seen the cases."""
    preds = [predict(c) for c in all_cases]
    ref = [predict(c) for c in reference] if reference else preds
    median = statistics.median(p.published_mfu for p in ref)
    const = {p.run: median / p.published_mfu - 1 for p in preds}
    return Validation(preds, const, {"presets": Knobs()})


def cross_validate(all_cases: list[Case]) -> Validation:
    """Leave one source out: fit on the others, predict it; the median constant likewise."""
    base = [predict(c) for c in all_cases]  # published MFU does not depend on the knobs
    pub_mfu = {p.run: p.published_mfu for p in base}
    preds: list[Prediction] = []
    const: dict[str, float] = {}
    knobs: dict[str, Knobs] = {}
    for source in dict.fromkeys(c.source for c in all_cases):
        held = [c for c in all_cases if c.source == source]
        train = [c for c in all_cases if c.source != source]
        k = fit(train)
        knobs[source] = k
        median = statistics.median(pub_mfu[c.id] for c in train)
        for c in held:
            preds.append(predict(c, k))
            const[c.id] = median / pub_mfu[c.id] - 1
    order = {c.id: i for i, c in enumerate(all_cases)}
    preds.sort(key=lambda p: order[p.run])
    return Validation(preds, const, knobs)


def error_band(v: Validation) -> float:
    """The cross-validated mean |error|: the half-width of the band around a predicted MFU."""
    return v.summary()["mean"]


# --------------------------------------------------------------------------------------------
# tables


def per_run_table(v: Validation) -> str:
    # the run column as wide as the longest id: a cut id no longer names its run
    w = max((len(p.run) for p in v.predictions), default=3) + 2
    head = (
        f"{'run':<{w}}{'metric':<19}{'published':>11}{'predicted':>11}{'error':>9}{'const':>9}  {'fits':<15}"
    )
    lines = [head + "filled (unpublished)"]
    for p in v.predictions:
        fits = f"{p.margin_gb:+.0f} GB" if p.fits else f"NO ({p.margin_gb:+.0f} GB)"
        lines.append(  # errors spaced so that 1000 % still parts from its neighbour
            f"{p.run:<{w}}{p.metric:<19}{p.published:>11.4g}{p.predicted:>11.4g}"
            f" {percent(p.error, 8, '+')} {percent(v.constant_errors[p.run], 8, '+')}  {fits:<15}{p.filled}"
        )
    return "\n".join(lines)


def source_table(v: Validation, title: str) -> str:
    w = max([len("all without `uncertain`")] + [len(source) for source in v.by_source()]) + 2
    head = (
        f"{'source':<{w}}{'runs':>5}{'mean':>8}{'worst':>8}{'const mean':>12}{'const worst':>13}{'no fit':>8}"
    )
    lines = [title, head]
    groups = [*v.by_source().items(), ("all", v.predictions), ("all without `uncertain`", v.certain())]
    for name, preds in groups:
        s = v.summary(preds)
        lines.append(
            f"{name:<{w}}{s['runs']:>5}{percent(s['mean'], 8)}{percent(s['worst'], 8)}"
            f"{percent(s['constant_mean'], 12)}{percent(s['constant_worst'], 13)}{s['not_fitting']:>8}"
        )
    return "\n".join(lines)


def knobs_table(v: Validation) -> str:
    lines = ["fitted knobs (left-out source: values)"]
    for source, k in v.knobs.items():
        lines.append(f"  {source:<28}" + "  ".join(f"{n}={x:g}" for n, x in k.to_dict().items()))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the per-metric comparison of the original published set (memory, per-layer times, Figure 7)


@dataclass
class Comparison:
    run: str
    metric: str
    published: float
    predicted: float

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    return _load_runs(path)


def compare(run: dict[str, Any]) -> tuple[Plan | None, list[Comparison]]:
    """Every metric a run publishes, predicted with the presets' knobs."""
    meas = run.get("measured", {})
    rid = run["id"]
    out: list[Comparison] = []
    inputs = build(run)
    if inputs is None:  # the ZeRO paper's per-device model state (fp16 weights and gradients)
        lt = run["layout"]
        psi = run["model"]["params_b"] * 1e9
        shape = TrainShape(
            seq_len=1,
            global_batch=1,
            grad_bytes=2,
            optimizer_bytes=optimizer_bytes(run),
            fp32_shard=False,  # the paper's ZeRO-3 keeps fp16 shards beside the fp32 optimizer state
        )
        n = lt.get("dp", 1)
        state = sum(model_state(psi, 0.0, int(lt.get("zero_stage", 0)), n, n, shape))
        if "model_state_memory_gb_per_gpu" in meas:
            out.append(Comparison(rid, "model state GB", meas["model_state_memory_gb_per_gpu"], state / 1e9))
        return None, out
    model, hw, layout, shape = inputs.model, inputs.hw, inputs.layout, inputs.shape
    p = plan(model, hw, layout, shape)
    mfu = p.mfu_causal if counts_causal_half(run) else p.mfu
    if "iteration_time_s" in meas:
        out.append(Comparison(rid, "step time s", meas["iteration_time_s"], p.step_time_s))
    if "tokens_per_s" in meas:
        out.append(Comparison(rid, "tokens/s", meas["tokens_per_s"], p.tokens_per_s))
    if "tflops_per_gpu" in meas:
        basis = meas.get("tflops_basis", "model")
        pred = p.hardware_tflops_per_gpu if basis == "hardware" else mfu * hw.peak_tflops
        out.append(Comparison(rid, f"TFLOP/s ({basis})", meas["tflops_per_gpu"], pred))
    if "mfu" in meas:
        out.append(
            Comparison(rid, "MFU", meas["mfu"], mfu * hw.peak_tflops / source_peak(run, hw, shape.fp8))
        )
    if "hfu" in meas:
        out.append(Comparison(rid, "HFU", meas["hfu"], p.hfu))
    if "analytic_param_optimizer_memory_gib_per_gpu" in meas:
        m = p.memory
        out.append(
            Comparison(
                rid,
                "model state GiB",
                meas["analytic_param_optimizer_memory_gib_per_gpu"],
                (m.params + m.grads + m.optimizer) / GIB,
            )
        )
    if "analytic_activation_memory_gib_per_gpu" in meas:
        out.append(
            Comparison(
                rid,
                "activations GiB",
                meas["analytic_activation_memory_gib_per_gpu"],
                p.memory.activations / GIB,
            )
        )
    for key, name in (("layer_forward_ms", "forward"), ("layer_backward_ms", "backward")):
        if key in meas:  # Korthikanti Table 4: one transformer layer, collectives and recompute included
            out.append(Comparison(rid, f"layer {name} ms", meas[key], 1e3 * p.stage_times[f"layer_{name}_s"]))
    if "fig7_activation_pct_of_tp_baseline" in meas:  # Korthikanti Figure 7: vs tp only, no recompute
        base = plan(model, hw, dataclasses.replace(layout, sp=False, recompute="none"), shape)
        pct = 100 * p.memory.activations / base.memory.activations
        out.append(Comparison(rid, "activations % of base", meas["fig7_activation_pct_of_tp_baseline"], pct))
    return p, out


def validate(path: str | Path, skipped: list[str] | None = None) -> list[Comparison]:
    """Comparisons for every run; runs fivefold cannot express are listed in `skipped` with the reason."""
    rows: list[Comparison] = []
    for run in load_runs(path):
        try:
            rows.extend(compare(run)[1])
        except (FivefoldError, KeyError, TypeError, ValueError) as exc:
            if skipped is None:
                raise
            skipped.append(f"{run.get('id')}: {exc}")
    return rows


def table(rows: list[Comparison]) -> str:
    lines = [f"{'run':<44}{'metric':<20}{'published':>11}{'predicted':>11}{'error':>9}"]
    for r in rows:
        lines.append(
            f"{r.run:<44}{r.metric:<20}{r.published:>11.4g}{r.predicted:>11.4g}{percent(r.error, 9, '+')}"
        )
    return "\n".join(lines)
