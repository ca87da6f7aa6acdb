"""`--search`: enumerate valid layouts, drop those that do not fit, rank by step time, explain the best.

Enumeration (world = dp·fsdp·cp·tp·pp): tp over divisors of the heads (kv heads replicated evenly),
pp over divisors of the rest up to the layer count, cp over powers of two that split the sequence,
then the data-parallel ranks as DDP (zero 0/1), FSDP (zero 2/3) or HSDP (fsdp inside, dp across),
ep over divisors of the experts that fold onto fsdp×cp, every pipeline schedule with its virtual
stages, micro-batch sizes, and the least activation recompute that fits (none < selective < full on
the first N blocks of each chunk < full on all of them in time, the reverse in memory, so the first
that fits is the fastest; N is bisected, memory falling as it grows).
Pruning, cheapest first: model state alone must fit; then memory with each recompute choice.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.config.layout import DEFAULT_ORDER, complete_order
from fivefold.errors import FivefoldError, divisors
from fivefold.plan.comm import links
from fivefold.plan.compute import on_this_host
from fivefold.plan.memory import (
    Memory,
    cached_stage_params,
    expert_rows,
    memory,
    most_chunk_layers,
    runs_own_tensors,
    shard_group,
    stage_names,
    stage_state,
)
from fivefold.plan.report import _plan, check_plan_inputs, model_facts, step_lower_bound
from fivefold.plan.result import Plan, capacity, size_words
from fivefold.plan.spec import TrainShape, resolve_arch
from fivefold.plan.trainers import trainer_refuses
from fivefold.support import check_microbatches, check_trainable

RECOMPUTE_ORDER = ("none", "selective", "full")


def lightest_recompute(
    base: Layout,
    model: ModelSpec,
    fits: Callable[[Layout], bool],
    recomputes: tuple[str, ...] = RECOMPUTE_ORDER,
    seq_len: int = 0,
) -> Layout | None:
    """`base` under the least recompute with which `fits` holds, or None: none, selective, then full
    recompute of the fewest blocks per chunk (`recompute_layers`, bisected: memory only falls as
    blocks are added), full on every block last. Megatron's `--recompute-num-layers` and TorchTitan's
    layer-level checkpointing of some blocks spend the memory left this way."""
    for rc in recomputes:
        lay = copy.copy(base)
        lay.recompute, lay.recompute_layers = rc, 0
        if rc != "full":
            if fits(lay):
                return lay
            continue
        if not fits(lay):
            return None
        most = most_chunk_layers(model, lay, seq_len)
        lo, hi = 1, most  # hi blocks (all of the largest chunk) fit
        while lo < hi:
            trial = copy.copy(lay)
            trial.recompute_layers = (lo + hi) // 2
            if fits(trial):
                hi = trial.recompute_layers
            else:
                lo = trial.recompute_layers + 1
        if hi < most:
            lay.recompute_layers = hi
        return lay
    return None


@dataclass
class SearchResult:
    plans: list[Plan]  # fitting layouts, fastest first
    considered: int
    fitting: int
    seconds: float
    explanation: list[str]
    # no plans because the inputs leave no layout to size (every one refused, or a batch none splits):
    # a mistake in the request, where "none fits in the memory" is an answer
    input_error: bool = False


def _tp_choices(model: ModelSpec, gpus: int, gpn: int) -> list[int]:
    out = []
    for t in divisors(math.gcd(model.heads, gpus)):
        if t > gpn:  # across nodes tensor parallelism only loses (plan still scores such layouts)
            continue
        if t > model.kv_heads and t % model.kv_heads:
            continue
        out.append(t)
    return out


def _schedules(pp: int, layers: int, moe: bool) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    # ZB-H1 keeps 1F1B's memory with a smaller bubble, but not every layout or trainer runs its
    # split backward (replicated tp weights, nanotron, DeepSpeed): 1F1B stays a candidate
    out = [("zero-bubble", 1), ("1f1b", 1)]
    # chunks need not split a rank's layers evenly: the cost-balanced split (layout_math.stage_split)
    # gives some chunks a layer more, as Llama 3's 126 layers ran on 16 stages
    per = layers // pp
    for v in (2, 3, 4, 6, 8):
        if per >= v:
            out.append(("interleaved-1f1b", v))
    if per >= 2:
        out.append(("zbv", 2))
        if moe:  # DualPipeV's gain over ZB-V is hiding the expert all-to-all
            out.append(("dualpipev", 2))
    return out


def _data_modes(
    rest: int, cp: int, gpn: int, split_weights: bool = False, ddp_too: bool = False
) -> list[tuple[int, int, int]]:
    """(dp, fsdp, zero) splits of the data-parallel ranks; `split_weights`: tp or ep shards the
    weights, which the runtime's ZeRO-1 (ZeroRedundancyOptimizer, plain tensors) cannot take.
    `ddp_too`: zero 1 sends more than DDP (ZeroRedundancyOptimizer's broadcasts after the all-reduce),
    so plain DDP is a candidate beside it."""
    if rest == 1:
        return [(1, 1, 0)]
    # elsewhere plain DDP (zero 0) is dominated by zero 1 (Megatron's distributed optimizer: the same
    # wire bytes, less memory) where zero 1 runs
    modes = [(rest, 1, 0 if split_weights else 1), (1, rest, 2), (1, rest, 3)]
    if ddp_too and not split_weights:
        modes.append((rest, 1, 0))
    for f in divisors(rest):  # HSDP: shard inside a node (or a few), replicate across
        if 1 < f < rest and f * cp <= 4 * gpn and (f & (f - 1)) == 0:
            modes.append((rest // f, f, 3))
    return modes


PINNABLE = (
    "dp",
    "fsdp",
    "tp",
    "pp",
    "cp",
    "ep",
    "zero",
    "sp",
    "pp_schedule",
    "virtual_stages",
    "recompute",
    "recompute_layers",
    "order",
    "cp_impl",
)


# pins a candidate carries as given; the axes, schedule and ZeRO stage are enumerated around the others
PINNED_AS_GIVEN = ("order", "cp_impl", "recompute", "recompute_layers")


def _pinned_data_modes(
    rest: int, cp: int, gpn: int, pins: dict, split_weights: bool = False, ddp_too: bool = False
) -> list[tuple[int, int, int]]:
    """(dp, fsdp, zero) splits that honour pinned dp, fsdp and zero."""
    dp, fsdp = pins.get("dp"), pins.get("fsdp")
    if dp is None and fsdp is None:
        modes = _data_modes(rest, cp, gpn, split_weights, ddp_too)
        if "zero" in pins:
            z = pins["zero"]
            modes = [m for m in modes if m[2] == z]
            # the stage asked for on the data axis that holds it (dp for 0 and 1, fsdp for 2 and 3),
            # also where the search would not choose it; train's checks below say if it runs
            natural = (rest, 1, z) if z < 2 else (1, rest, z)
            if natural not in modes:
                modes.append(natural)
        return modes
    if dp is not None and fsdp is not None:
        pairs = [(dp, fsdp)] if dp * fsdp == rest else []
    elif dp is not None:
        pairs = [(dp, rest // dp)] if rest % dp == 0 else []
    else:
        pairs = [(rest // fsdp, fsdp)] if rest % fsdp == 0 else []
    out = []
    for d, f in pairs:
        plain = [0] if split_weights else [1, 0] if ddp_too else [1]
        zeros = (
            [pins["zero"]] if "zero" in pins else ([2, 3] if d == 1 and f > 1 else [3] if f > 1 else plain)
        )
        # sharded weights: zero 2 or 3, which only FSDP shards (pins that leave none are named by
        # train's own check of the layout they make, `_pins_refused`)
        out += [(d, f, z) for z in zeros if not (f > 1 and z < 2) and not (f == 1 and z >= 2 and d * cp > 1)]
    return out


def candidates(
    model: ModelSpec, hw: HardwareSpec, gpus: int, shape: TrainShape, gpn: int, pins: dict | None = None
) -> Iterator[Layout]:
    """Every layout the search scores (before memory pruning and micro-batch choice); `pins` (layout
    fields the user fixed) restrict each axis to the given value."""
    pins = pins or {}
    tps = [pins["tp"]] if "tp" in pins else _tp_choices(model, gpus, gpn)
    if pins.get("sp") and "tp" not in pins:
        tps = [t for t in tps if t > 1]  # sequence parallelism asked for is tensor parallelism asked for
    for tp in (t for t in tps if gpus % t == 0):
        pps = [pins["pp"]] if "pp" in pins else divisors(gpus // tp)
        if "pp" not in pins and ("pp_schedule" in pins or pins.get("virtual_stages", 1) > 1):
            pps = [q for q in pps if q > 1]  # a schedule asked for is a pipeline asked for
        for pp in (q for q in pps if (gpus // tp) % q == 0):
            if pp > model.layers:
                break
            cps = (
                [pins["cp"]] if "cp" in pins else [c for c in divisors(gpus // (tp * pp)) if c & (c - 1) == 0]
            )
            for cp in (c for c in cps if (gpus // (tp * pp)) % c == 0):
                if "cp" not in pins and cp > 1 and (shape.seq_len % (2 * cp) or shape.seq_len // cp < 1024):
                    continue
                rest = gpus // (tp * pp * cp)
                split = tp > 1 or (model.is_moe and pins.get("ep", 2) > 1)
                for dp, fsdp, zero in _pinned_data_modes(rest, cp, gpn, pins, split, shape.zero1_broadcasts):
                    eps = [1]
                    if model.is_moe:
                        room = fsdp * cp
                        eps = [e for e in divisors(math.gcd(room, model.experts))]
                    if "ep" in pins:  # folded onto fsdp × cp, as train folds it: it must divide them
                        eps = [pins["ep"]] if (fsdp * cp) % pins["ep"] == 0 else []
                    scheds = _schedules(pp, model.layers, model.is_moe)
                    if "pp_schedule" in pins and pp > 1:
                        v_pin = pins.get("virtual_stages")
                        v_default = (
                            2 if pins["pp_schedule"] in ("interleaved-1f1b", "zbv", "dualpipev") else 1
                        )
                        scheds = [(pins["pp_schedule"], v_pin or v_default)]
                    elif "virtual_stages" in pins and pp > 1:
                        v_pin = pins["virtual_stages"]
                        scheds = [(sc, v) for sc, v in scheds if v == v_pin] or [("interleaved-1f1b", v_pin)]
                    scheds = [(sc, v) for sc, v in scheds if pp * v <= model.layers]  # a layer a chunk
                    for ep in eps:
                        for sched, v in scheds:
                            yield Layout(
                                dp=dp,
                                fsdp=fsdp,
                                tp=tp,
                                pp=pp,
                                cp=cp,
                                ep=ep,
                                zero=zero,
                                sp=pins.get("sp", tp > 1) and tp > 1,
                                pp_schedule=sched,
                                virtual_stages=v,
                                # a pinned recompute is the layout's from the start, so train's checks
                                # see it (DualPipeV refuses full recompute)
                                **{k: pins[k] for k in PINNED_AS_GIVEN if k in pins},
                            )


def _check_pins(model: ModelSpec, pins: dict) -> None:
    """Pins no layout can hold, refused as train refuses the flags: --ep on a dense model, more chunks
    than layers, and flags that contradict each other whatever the world (--fsdp 8 --zero 1), checked
    on some pipeline when a schedule is asked for (--pp-schedule zbv --virtual-stages 3)."""
    Layout(ep=pins.get("ep", 1)).check_experts(model)
    if "pp" in pins and "virtual_stages" in pins:
        Layout(pp=pins["pp"], virtual_stages=pins["virtual_stages"]).check_model(model)
    # ep is left out: whether it divides fsdp × cp is the candidates' business when those are searched
    given = {k: v for k, v in _given_pins(pins).items() if k != "ep"}
    Layout(**given).resolve()


def _given_pins(pins: dict, gpus: int = 0) -> dict:
    """The pins as Layout fields; a pinned block count implies full recompute (`plan --search` itself
    asks for --recompute full), and a pinned schedule or chunk count a pipeline: the smallest one a
    world of `gpus` has (2 without a world)."""
    given = {k: v for k, v in pins.items() if k in PINNABLE}
    if given.get("recompute_layers"):
        given.setdefault("recompute", "full")
    if "pp" not in given and ("pp_schedule" in given or given.get("virtual_stages", 1) > 1):
        given["pp"] = min((d for d in divisors(gpus) if d > 1), default=2)
    return given


def search(
    model: ModelSpec,
    hw: HardwareSpec,
    gpus: int,
    shape: TrainShape,
    gpus_per_node: int | None = None,
    top: int = 5,
    micro_batches: tuple[int, ...] = (1, 2, 4, 8),
    pins: dict | None = None,
    trainer: dict | None = None,
) -> SearchResult:
    """The `top` fastest layouts that fit. `pins` fixes layout fields (keys of PINNABLE, and
    `micro_batch`); everything else is searched. `trainer` (facts of `fivefold.plan.trainers`):
    only layouts that trainer also runs (`plan --search --trainer NAME`)."""
    pins = {k: v for k, v in (pins or {}).items() if v is not None}
    for fill, other in (("dp", "fsdp"), ("fsdp", "dp")):
        if pins.get(fill) == -1:  # "this axis takes the data ranks the others leave": the other is 1
            del pins[fill]
            pins.setdefault(other, 1)
    _check_pins(model, pins)
    if "micro_batch" in pins:
        micro_batches = (pins.pop("micro_batch"),)
    start = time.perf_counter()
    gpn = gpus_per_node or hw.gpus_per_node
    shape = shape.on(hw)
    hw = on_this_host(hw, gpus, gpn)
    arch = resolve_arch(model, shape.block, shape.attention, shape.expert_tp)
    cap = capacity(hw)
    facts = model_facts(model, arch, shape.seq_len)
    memo: dict = {}
    considered = fitting = 0
    # why train refuses a candidate whose state fits; whether any such one passed train's checks
    refusal, runnable = "", False
    # why nothing fits, if nothing does: layouts whose model state fits, and of those, the ones whose
    # batch splits into a micro-batch tried (the rest of those ran out of activation memory)
    state_fits = batch_splits = 0
    state_cache: dict[tuple, float] = {}
    shapes = [(b, dataclasses.replace(shape, micro_batch=b)) for b in micro_batches]
    bounded: list[tuple[float, int, Layout, TrainShape, int, Memory]] = []
    if "recompute_layers" in pins or pins.get("recompute") == "full":
        # --recompute full alone means every block, as in train; a block count implies full
        pins["recompute_layers"] = pins.get("recompute_layers", 0)
        pins["recompute"] = "full"
    recomputes = (pins["recompute"],) if "recompute" in pins else RECOMPUTE_ORDER
    produced = 0
    exact = runs_own_tensors(model, arch, shape)  # the stage's parameters as the runtime cuts them
    for base in candidates(model, hw, gpus, shape, gpn, pins):
        produced += 1
        n = shard_group(base)
        ends = tuple(stage_names(base, model, shape.seq_len))
        key = (base.tp, base.pp, base.ep, base.zero, n, ends, base.virtual_stages, base.pp_schedule)
        if key not in state_cache:  # model state of the worst stage (the split decides it), no batch
            worst = 0.0
            rows = expert_rows(model, base)
            for which in ends:
                dense, experts, _ = cached_stage_params(model, arch, base, which, memo, shape.seq_len, exact)
                worst = max(worst, sum(stage_state(dense, experts, base, shape, rows)[:3]))
            state_cache[key] = worst
        if state_cache[key] > cap:
            considered += 1
            continue
        state_fits += 1
        data = base.dp * base.fsdp
        if shape.global_batch % data:
            continue
        try:  # what `train` refuses (check_trainable), never proposed; the recompute chosen below is
            # checked again
            check_plan_inputs(model, base, shape)
            check_trainable(model, base, shape.seq_len)
        except FivefoldError as exc:
            refusal = refusal or str(exc)
            continue
        if trainer and (why := trainer_refuses(trainer, base)):
            refusal = refusal or f"the trainer does not run {why}"
            continue
        runnable = True
        for b, sh in shapes:
            if (shape.global_batch // data) % b:
                continue
            m = shape.global_batch // (data * b)
            if base.pp_schedule == "interleaved-1f1b" and m % base.pp:
                continue
            if base.pp > 1:
                try:
                    check_microbatches(base.pp, m, base.pp_schedule)
                except FivefoldError:
                    continue
            batch_splits += 1
            tried: dict[tuple[str, int], Memory] = {}

            def fits(lay: Layout, sh: TrainShape = sh, m: int = m, tried: dict = tried) -> bool:
                mem = memory(model, arch, lay, sh, m, memo)
                tried[(lay.recompute, lay.recompute_layers)] = mem
                return mem.total <= cap

            if "recompute_layers" in pins:  # every choice pinned: only whether it fits
                lay = copy.copy(base)
                lay.recompute, lay.recompute_layers = "full", pins["recompute_layers"]
                chosen = lay if fits(lay) else None
            else:
                chosen = lightest_recompute(base, model, fits, recomputes, shape.seq_len)
            considered += len(tried)
            if chosen is None:
                continue
            if chosen.recompute != base.recompute:  # the recompute it needs may be one train refuses
                try:  # (DualPipeV with full recompute)
                    check_trainable(model, chosen, shape.seq_len)
                except FivefoldError:
                    continue
            fitting += 1
            bound = step_lower_bound(model, arch, hw, chosen, sh, m, memo)
            mem = tried[(chosen.recompute, chosen.recompute_layers)]
            bounded.append((bound, len(bounded), chosen, sh, m, mem))
    # branch and bound: score layouts in order of their collective-free bound, stop when the bound
    # alone is slower than the top-k found so far
    bounded.sort(key=lambda item: item[:2])
    top = top if top > 0 else len(bounded)  # 0: every layout that fits
    results: list[Plan] = []
    slowest_kept: list[float] = []  # max-heap (negated) of the top-k step times so far
    for bound, _, lay, sh, m, mem in bounded:
        if len(slowest_kept) >= top and bound >= -slowest_kept[0]:
            break
        p = _plan(model, hw, lay, sh, arch, gpn, m, mem, facts, memo)
        results.append(p)
        heapq.heappush(slowest_kept, -p.step_time_s)
        if len(slowest_kept) > top:
            heapq.heappop(slowest_kept)
    results.sort(key=lambda p: (round(p.step_time_s, 9), _axes_used(p.layout), p.memory.total))
    best = results[:top]
    input_error = False
    if best:
        explanation = explain(best, model, hw, gpus, gpn)
    else:
        if not produced:  # no layout of this world holds the pins together: train's own word on why
            refusal, runnable = _pins_refused(model, pins, gpus, shape), False
        why, input_error = _why_none(pins, refusal, runnable, state_fits, batch_splits, micro_batches, shape)
        explanation = [why]
    return SearchResult(best, considered, fitting, time.perf_counter() - start, explanation, input_error)


def _pins_refused(model: ModelSpec, pins: dict, gpus: int, shape: TrainShape) -> str:
    """Why the pins make no layout of `gpus`: the layout train builds from the same flags (the data
    ranks filling the rest) and the first of its checks that refuses it, else a plain statement."""
    given = _given_pins(pins, gpus)
    if "dp" not in given and "fsdp" not in given:
        given["dp"] = -1  # train's default: plain data parallelism fills the world
    try:
        lay = Layout(**given).resolve(gpus)
        check_plan_inputs(model, lay, shape)
        check_trainable(model, lay, shape.seq_len)
    except FivefoldError as exc:
        return str(exc)
    return f"no layout of {gpus} GPUs holds these values together"


def _why_none(
    pins: dict,
    refusal: str,
    runnable: bool,
    state_fits: int,
    batch_splits: int,
    micro_batches: tuple[int, ...],
    shape: TrainShape,
) -> tuple[str, bool]:
    """Why a search found no layout: the first obstacle every candidate met, and whether it is a
    mistake in the request (every layout refused, a batch none splits) rather than an answer."""
    # a block count of 0 is "every block", which --recompute full already says
    fixed = ", ".join(f"{k}={v}" for k, v in pins.items() if (k, v) != ("recompute_layers", 0))
    with_fixed = f" with {fixed} fixed" if fixed else ""
    if refusal and not runnable:  # every layout small enough to hold its state is refused
        return f"no layout{with_fixed} can be trained: {refusal}", True
    if not state_fits:
        state = "the model state alone exceeds GPU memory at every sharding degree tried"
        return f"no layout fits{with_fixed}: {state}", False
    sizes = " or ".join(map(str, micro_batches))
    if not batch_splits:
        return (
            f"no layout{with_fixed} splits --global-batch {shape.global_batch} into micro-batches of {sizes} "
            "over its data ranks (and a pipeline's micro-batch count); give a --global-batch that is a "
            "multiple of the micro-batch times the data ranks"
        ), True
    lower = " lower --micro-batch or" if len(micro_batches) == 1 and micro_batches[0] > 1 else ""
    return (
        f"no layout fits{with_fixed}: the model state fits, but not the activations of micro-batch {sizes} "
        f"at {shape.seq_len} tokens, even with the heaviest recompute tried;{lower} add GPUs"
    ), False


def _axes_used(lay: Layout) -> int:
    """Ties go to the layout with fewer model-splitting axes (add one only when needed)."""
    return sum(getattr(lay, a) > 1 for a in ("tp", "pp", "cp", "ep"))


def explain(plans: list[Plan], model: ModelSpec, hw: HardwareSpec, gpus: int, gpn: int) -> list[str]:
    """The best layout in words, in docs/planner.md's decision order: TP, PP, DP, then SP/CP, then EP."""
    p = plans[0]
    lay = p.layout
    lines = [
        f"Best: {plan_flags(p)}: step {p.step_time_s:.3g} s, "
        # against what the planner may fill, in the same decimal GB (an "80 GB" H100 holds 82.5 usable)
        f"MFU {p.mfu:.1%}, {size_words(p.memory.total)} of {size_words(capacity(hw))} usable per GPU."
    ]
    weights = p.params * p.shape.param_bytes
    bits = 8 * p.shape.param_bytes
    if lay.tp == 1:
        how = [w for w, used in (("pipelined", lay.pp > 1), ("sharded", lay.zero >= 3)) if used]
        lines.append(
            f"1. No tensor parallelism: the {bits}-bit weights ({size_words(weights)}) fit without it"
            f"{' once ' + ' and '.join(how) if how else ''}, so every matmul stays whole and no per-layer "
            "collective is paid."
        )
    else:
        t_words = (
            "inside one node (NVLink)" if lay.tp <= gpn else "across nodes (slow: no smaller choice fit)"
        )
        lines.append(
            f"1. Tensor parallel {lay.tp} {t_words}: the {bits}-bit weights are {size_words(weights)}; "
            f"tp splits every layer's matmuls, and its per-layer collectives cost "
            f"{_axis_time(p, 'tp'):.3g} s a step on the fast link."
        )
    if lay.pp > 1:
        where = {
            "intra": "inside one node",
            "inter": "across nodes",
            "mixed": "partly across nodes",
        }[links(lay, gpn).get("pp", "intra")]
        crossing = (
            "only activations cross the slower link"
            if where != "inside one node"
            else "stages pass activations"
        )
        lines.append(
            f"2. Pipeline parallel {lay.pp} {where} ({lay.pp_schedule}, {lay.virtual_stages} "
            f"chunk(s) per rank, {p.microbatches} micro-batches): {crossing}; the bubble is "
            f"{p.bubble_fraction:.1%} of the step."
        )
    else:
        lines.append("2. No pipeline: the model state fits without splitting the layer stack, so no bubble.")
    data = lay.dp * lay.fsdp
    zero_words = {
        0: "plain DDP (full copies)",
        1: "DDP with a sharded optimizer (ZeRO-1)",
        2: "FSDP with sharded gradients (ZeRO-2)",
        3: "FSDP with sharded weights (ZeRO-3)",
    }[lay.zero]
    hsdp = f", HSDP: shards over {lay.fsdp}, replicas over {lay.dp}" if lay.dp > 1 and lay.fsdp > 1 else ""
    if data == 1:
        lines.append("3. No data parallelism: the model's splits take every GPU, so no gradient traffic.")
    else:
        lines.append(
            f"3. Data parallel {data} for throughput: {zero_words}{hsdp}; gradient traffic "
            f"{sum(_axis_time(p, a) for a in GRADIENT_AXES):.3g} s a step, "
            f"{_axis_exposed(p, GRADIENT_AXES):.3g} s of it not hidden behind the backward."
        )
    extra = []
    if lay.sp:
        extra.append("sequence parallel shards the norm/residual activations over tp")
    if lay.cp > 1:
        extra.append(f"context parallel {lay.cp} splits the {p.shape.seq_len}-token sequence")
    if lay.recompute != "none":
        extra.append(f"{lay.recompute_label} recompute, because keeping every activation does not fit")
    lines.append(
        "4. Activations: "
        + ("; ".join(extra) if extra else "no SP/CP/recompute needed")
        + f" ({size_words(p.memory.activations)} per GPU)."
    )
    if model.is_moe and lay.ep == 1:
        lines.append(
            f"5. No expert parallelism: every rank holds all {model.experts} experts, no all-to-all."
        )
    elif model.is_moe:
        lines.append(
            f"5. Expert parallel {lay.ep}: each rank holds {model.experts // lay.ep} of "
            f"{model.experts} experts; all-to-all {_axis_time(p, 'ep'):.3g} s a step."
        )
    for i, q in enumerate(plans[1:3], start=2):
        lines.append(
            f"#{i}: {plan_flags(q)}: {q.step_time_s / p.step_time_s - 1:+.1%} step time ({_why(p, q)})."
        )
    return lines


# the ledger's names of the groups gradients are reduced over: the data axes alone or flattened with
# cp (layout_math.replica_axis), whose ranks also hold a share of every weight
GRADIENT_AXES = ("dp", "fsdp", "batch", "fsdp_cp", "dp_fsdp_cp")


def _axis_time(p: Plan, axis: str) -> float:
    return sum(c.time_s for c in p.comm if c.axis == axis)


def _axis_exposed(p: Plan, axes: tuple[str, ...]) -> float:
    return sum(c.exposed_s for c in p.comm if c.axis in axes)


def _why(best: Plan, other: Plan) -> str:
    parts = []
    if other.bubble_time_s > best.bubble_time_s * 1.05:
        parts.append(f"bubble {other.bubble_fraction:.1%} vs {best.bubble_fraction:.1%}")
    if other.exposed_comm_s > best.exposed_comm_s * 1.05:
        parts.append(f"exposed comm {other.exposed_comm_s:.3g} s vs {best.exposed_comm_s:.3g} s")
    if other.compute_time_s > best.compute_time_s * 1.02:
        parts.append(f"compute {other.compute_time_s:.3g} s vs {best.compute_time_s:.3g} s")
    return ", ".join(parts) or "close"


def plan_flags(p: Plan) -> str:
    """A plan's layout and batch split as flags that `plan` and `train` both read the same way: with a
    pipeline, --microbatches says how a data rank's batch is split (train's default split is 2 × pp)."""
    out = f"{layout_flags(p.layout)} --micro-batch {p.shape.micro_batch}"
    return out + (f" --microbatches {p.microbatches}" if p.layout.pp > 1 else "")


def layout_flags(lay: Layout) -> str:
    parts = [
        f"--{a} {getattr(lay, a)}" for a in ("tp", "pp", "cp", "dp", "fsdp", "ep") if getattr(lay, a) > 1
    ]
    parts.append(f"--zero {lay.zero}")
    if lay.sp:
        parts.append("--sp")
    if lay.pp > 1:
        parts.append(f"--pp-schedule {lay.pp_schedule}")
        if lay.virtual_stages > 1 and lay.pp_schedule == "interleaved-1f1b":
            parts.append(f"--virtual-stages {lay.virtual_stages}")
    parts.append(f"--recompute {lay.recompute}")
    if lay.recompute_layers:
        parts.append(f"--recompute-layers {lay.recompute_layers}")
    if lay.cp > 1 and lay.cp_impl != "ring":
        parts.append(f"--cp-impl {lay.cp_impl}")
    order = complete_order(lay.order)
    if order != DEFAULT_ORDER:
        parts.append(f"--order {order}")
    return " ".join(parts)


def min_tp_for_weights(params: float, bytes_per_param: int, gpu_memory_gb: float) -> int:
    """Smallest power-of-two tensor-parallel degree whose weight shard fits a GPU."""
    tp = 1
    while params * bytes_per_param / tp > gpu_memory_gb * 1e9:
        tp *= 2
    return tp


def data_parallel_replicas(gpus: int, tp: int, pp: int) -> int:
    if gpus % (tp * pp):
        raise FivefoldError(f"tp×pp = {tp * pp} must divide {gpus} GPUs")
    return gpus // (tp * pp)
