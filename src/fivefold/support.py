"""What the runtime can train: one check shared by the planner's search, `plan`, `train` and `verify`.

`check_trainable` raises `FivefoldError` (one line: the constraint and the valid values) for exactly
the layouts the runtime cannot run, and returns quietly for every other one. It is torch-free, so
the search calls it on every candidate: nothing the planner proposes is refused at run time.

Refused on purpose (torch cannot, or not exactly):
  * split-backward schedules (zero-bubble, zbv, dualpipev) with FSDP at ZeRO-3: the weight-gradient
    pass walks the graph from the parameters, which ZeRO-3 has swapped back to shards by then;
  * DualPipeV with full recompute: torch's schedule detaches a view in place;
  * zero-bubble and ZB-V with full recompute and per-layer collectives (tp, cp, ep): the last stage
    re-runs recomputed forwards for its weight-gradient pass, their collectives with them, more
    often than the plan (and the ledger it is checked against) can count;
  * split-backward schedules over tensor-parallel weights replicated by torch's `replicate`
    (tp with dp or cp replicas and no fsdp): its unsharded parameters are not the ones the
    weight-gradient pass looks up;
  * ZeRO-1 (ZeroRedundancyOptimizer) over tensor-parallel or expert-parallel shards (DTensors);
  * HSDP with dp inside fsdp or cp in --order: torch slices FSDP's (dp, fsdp×cp) mesh only in the
    world mesh's own order.
"""

from __future__ import annotations

from fivefold.config import Layout, ModelSpec
from fivefold.errors import FivefoldError, divisors, suggest
from fivefold.layout_math import SINGLE_STAGE, SPLIT_BACKWARD, V_SHAPED, interleaved_needs_chunks, parse_split


def check_trainable(model: ModelSpec, layout: Layout, seq_len: int | None = None) -> None:
    """Refuse a resolved `layout` the runtime cannot train on `model` (at `seq_len`, when given).

    The micro-batch count is checked when the layout carries one (`microbatches > 0`); the
    search, which picks it later, calls `check_microbatches` itself.
    """
    layout.check_model(model, seq_len)
    if layout.tp > 1:
        check_tensor_shapes(model, layout.tp)
    if layout.zero == 1 and layout.tp > 1 and layout.dp > 1:
        raise FivefoldError(
            f"--zero 1 (ZeroRedundancyOptimizer) works on DDP's plain replicated weights, not on the "
            f"tensor-parallel shards of --tp {layout.tp}; use --fsdp to shard optimizer state with TP, "
            "or --zero 0"
        )
    if layout.zero == 1 and layout.ep > 1 and layout.dp > 1:
        raise FivefoldError(
            f"--zero 1 (ZeroRedundancyOptimizer) broadcasts plain tensors, not the expert shards of "
            f"--ep {layout.ep}; use --fsdp (--zero 2 or 3) for the data-parallel ranks, or --zero 0"
        )
    if layout.fsdp == 1 and layout.zero >= 2 and layout.dp * layout.cp > 1:
        # ZeRO-2/3 is FSDP's sharding here: plain dp replicas (DDP) or cp ranks would hold everything
        # whole (published runs that shard over cp alone, torchtitan's, are still planned)
        what = "gradients and parameters" if layout.zero == 3 else "gradients"
        shard = f"--fsdp {layout.dp} --dp 1 --zero {layout.zero}" if layout.dp > 1 else "--fsdp N"
        raise FivefoldError(
            f"--zero {layout.zero} shards {what} with FSDP, and with --fsdp 1 the dp×cp = "
            f"{layout.dp * layout.cp} data ranks would hold them whole: use {shard}, or --zero 1 (a "
            "sharded optimizer) or 0"
        )
    check_hsdp_order(layout)
    if layout.pp > 1:
        check_pipeline_shape(model, layout)
        if layout.microbatches > 0:
            check_microbatches(layout.pp, layout.microbatches, layout.pp_schedule)


def check_hsdp_order(layout: Layout) -> None:
    """HSDP shards inside each replica: FSDP's 2-D (dp, fsdp×cp) mesh is a slice of the world's, which
    torch takes only with dp outside the sharded axes, so --order must list fsdp and cp before dp."""
    if layout.dp == 1 or layout.fsdp == 1:
        return
    order = layout.order_list
    inside = [a for a in ("fsdp", "cp") if getattr(layout, a) > 1 and order.index(a) > order.index("dp")]
    if inside:
        fixed = [a for a in order if a != "dp"]
        fixed.insert(max(fixed.index(a) for a in inside) + 1, "dp")
        raise FivefoldError(
            f"--dp {layout.dp} with --fsdp {layout.fsdp} (HSDP) shards inside each replica, so --order "
            f"must list {' and '.join(inside)} before dp (innermost first); e.g. --order {','.join(fixed)}"
        )


def check_tensor_shapes(model: ModelSpec, tp: int) -> None:
    """Shapes tensor parallelism splits: heads (KV heads divided or replicated), ffn and vocab."""
    valid = [d for d in divisors(model.heads) if d <= model.kv_heads or d % model.kv_heads == 0]
    if model.heads % tp or (tp > model.kv_heads and tp % model.kv_heads):
        raise FivefoldError(
            f"--tp {tp} must divide the {model.heads} query heads and either divide the {model.kv_heads} KV "
            f"heads or be a multiple of them (KV heads are then replicated); valid tp: {suggest(valid)}"
        )
    for name, size in (("ffn_hidden", model.ffn_hidden), ("vocab", model.vocab)):
        if size % tp:
            raise FivefoldError(
                f"--tp {tp} must divide {name} = {size} of {model.name}; valid tp: "
                f"{suggest([d for d in valid if size % d == 0])}"
            )


def check_pipeline_shape(model: ModelSpec, layout: Layout) -> None:
    """Stages, chunks and schedule of a pipelined layout (pp > 1), without the batch."""
    pp, v, sched = layout.pp, layout.virtual_stages, layout.pp_schedule
    chunks = pp * v
    if pp > model.layers:
        raise FivefoldError(
            f"--pp {pp} exceeds the {model.layers} layers of {model.name}: every stage needs a layer; "
            f"valid pp: {suggest(range(1, model.layers + 1))}"
        )
    if sched in SINGLE_STAGE and v != 1:
        raise FivefoldError(
            f"--pp-schedule {sched} runs one chunk per rank, got --virtual-stages {v}; use "
            "--virtual-stages 1 or an interleaved schedule (interleaved-1f1b, zero-bubble)"
        )
    if sched == "interleaved-1f1b" and v < 2:
        raise interleaved_needs_chunks(model.layers, layout.pp)
    if sched in V_SHAPED and v != 2:
        raise FivefoldError(
            f"--pp-schedule {sched} folds exactly 2 chunks per rank into a V; use --virtual-stages 2"
        )
    if chunks > model.layers:
        ok = list(range(1, model.layers // pp + 1))
        raise FivefoldError(
            f"--pp {pp} × --virtual-stages {v} = {chunks} chunks exceeds the {model.layers} layers of "
            f"{model.name}; valid virtual stages for pp {pp}: {suggest(ok)}"
        )
    if layout.pp_split:  # its counts (a middle chunk with no layer, say) before any rank starts
        parse_split(layout.pp_split, model.layers, chunks)
    if layout.fsdp > 1 and layout.zero == 3 and sched in SPLIT_BACKWARD:
        raise FivefoldError(
            f"--pp-schedule {sched} computes weight gradients after the input gradients, which needs "
            f"FSDP's gathered parameters kept from forward to backward: use --zero 2 with --fsdp "
            f"{layout.fsdp}, or a schedule without the split (gpipe, 1f1b, interleaved-1f1b)"
        )
    replicas = layout.dp * layout.cp
    if sched in SPLIT_BACKWARD and layout.tp > 1 and layout.fsdp == 1 and replicas > 1:
        raise FivefoldError(
            f"--pp-schedule {sched} computes weight gradients in a pass of their own, which torch's "
            f"replicate (tensor-parallel weights replicated over dp×cp = {replicas}) does not track; "
            "shard them instead (--fsdp with --zero 2), or use gpipe, 1f1b or interleaved-1f1b"
        )
    per_layer = [f"--{a} {getattr(layout, a)}" for a in ("tp", "cp", "ep") if getattr(layout, a) > 1]
    if sched in ("zero-bubble", "zbv") and layout.recompute == "full" and per_layer:
        raise FivefoldError(
            f"--pp-schedule {sched} with --recompute full re-runs recomputed forwards, and their "
            f"per-layer collectives ({', '.join(per_layer)}), in its separate weight-gradient pass, more "
            "often than the plan can count; use --recompute selective, or 1f1b or interleaved-1f1b"
        )
    if sched == "dualpipev" and layout.recompute == "full":
        what = "--recompute full"
        raise FivefoldError(
            f"--pp-schedule dualpipev cannot run with {what} (torch's schedule detaches an activation "
            "view in place); use zbv or interleaved-1f1b, or drop " + what
        )


def min_microbatches(pp: int, schedule: str) -> int:
    if schedule == "gpipe":
        return 1
    if schedule == "dualpipev":
        return 2 * pp  # at least one micro-batch per chunk
    return pp  # 1F1B and the interleaved family fill the pipeline before the steady state


def pipeline_micro_batch(layout: Layout, local: int) -> int:
    """Sequences per pipeline micro-batch when a data rank's `local` sequences are split into the
    layout's --microbatches, as train splits them; one line with the valid counts where they do not."""
    if local <= 0 or local % layout.microbatches:
        ok = (
            [d for d in divisors(local) if d >= min_microbatches(layout.pp, layout.pp_schedule)]
            if local > 0
            else []
        )
        raise FivefoldError(
            f"each data-parallel rank's batch of {local} sequences does not divide into --microbatches "
            f"{layout.microbatches}; valid microbatches: {suggest(ok) or 'none'}"
        )
    return local // layout.microbatches


def run_micro_batch(layout: Layout, micro_batch: int, step_batch: int) -> int:
    """The micro-batch a plan counts for a run of train's flags: train splits a pipelined data rank's
    batch (of a `step_batch` over the data ranks) into --microbatches, and each is what a plan calls a
    micro-batch (--micro-batch is then the batch's accumulation unit); else --micro-batch itself."""
    if layout.pp > 1 and layout.microbatches:
        return pipeline_micro_batch(layout, step_batch // layout.data_parallel)
    return micro_batch


def step_split(layout: Layout, micro_batch: int, accumulation: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per step) of a data rank that accumulates
    `accumulation` micro-batches of `micro_batch`: those, or with a pipeline its whole batch split into
    the schedule's --microbatches, as train splits it (what `fivefold.plan.step` is to be told)."""
    if layout.pp == 1:
        return micro_batch, accumulation
    return pipeline_micro_batch(layout, micro_batch * accumulation), layout.microbatches


def _in_rounds(pp: int, m: int, schedule: str) -> bool:
    """Interleaved 1F1B and zero-bubble run micro-batches in rounds: m a multiple of m // pp."""
    return schedule not in ("interleaved-1f1b", "zero-bubble") or m % max(1, m // pp) == 0


def valid_microbatches(pp: int, schedule: str, count: int = 8) -> list[int]:
    """The first `count` micro-batch counts the schedule runs with `pp` stages (what its errors list)."""
    need = min_microbatches(pp, schedule)
    out, m = [], need
    while len(out) < count:
        if _in_rounds(pp, m, schedule):
            out.append(m)
        m += 1
    return out


def check_microbatches(pp: int, m: int, schedule: str) -> None:
    need = min_microbatches(pp, schedule)
    if m < need:
        raise FivefoldError(
            f"--pp-schedule {schedule} needs at least {need} micro-batches with --pp {pp}, got "
            f"--microbatches {m}; valid: {suggest(valid_microbatches(pp, schedule))} or more"
        )
    if not _in_rounds(pp, m, schedule):
        valid = suggest(valid_microbatches(pp, schedule))
        raise FivefoldError(
            f"--pp-schedule {schedule} runs micro-batches in rounds of {pp}: --microbatches {m} must "
            f"be a multiple of m // pp = {max(1, m // pp)}; valid: {valid}"
        )
