"""Human output of the planner: tables and a terminal bar chart of the memory breakdown."""

from __future__ import annotations

from fivefold.plan.result import MFU_BAND, Plan, capacity, fit_words, size_words
from fivefold.plan.runshape import dtype_name

BAR_WIDTH = 48
PARTS = (("params", "█"), ("grads", "▓"), ("optimizer", "▒"), ("activations", "░"), ("buffers", "·"))


def train_split_hint(p: Plan) -> str:
    """The flags with which `fivefold train` runs a pipelined plan's batch split, where its own default
    (a data rank's batch in 2 × pp micro-batches, the plan's resolved layout) differs; else ""."""
    if p.layout.pp == 1 or p.microbatches == p.layout.microbatches:
        return ""
    return (
        f"fivefold train runs this batch split with --micro-batch {p.shape.micro_batch} --microbatches "
        f"{p.microbatches} (untold, it splits a data rank's batch into {p.layout.microbatches})"
    )


def byte_unit(largest: float) -> tuple[float, str]:
    """(divisor, name) of the decimal unit a column of byte counts up to `largest` reads best in: a
    tiny model's state in MB or kB rather than a column of 0.00 GB."""
    for size, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if largest >= size:
            return size, name
    return 1.0, "B"


def count_words(n: float) -> str:
    """A parameter count as people write it: 671.00B, 8.03B, 0.84M, 53.54K (`presets` lists them so)."""
    for size, name in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f}{name}"
    return str(int(n))


def memory_chart(parts: dict[str, float], cap: float, apart: str | None = None) -> list[str]:
    """One bar per part, scaled to the GPU's capacity, then the stacked total against it; a part
    `apart` (never alive at the peak beside the others) has its own bar but no share of the total."""
    total = sum(v for k, v in parts.items() if k != apart)
    scale = max(cap, total)
    size, unit = byte_unit(total)
    lines = []
    stacked = ""
    for name, ch in PARTS:
        if name not in parts:
            continue
        n = round(BAR_WIDTH * parts[name] / scale)
        lines.append(f"  {name:<12}{parts[name] / size:8.2f} {unit:<2}  {ch * n}")
        if name != apart:
            stacked += ch * n
    cap_mark = round(BAR_WIDTH * cap / scale)
    bar = stacked.ljust(BAR_WIDTH)
    bar = bar[:cap_mark] + "|" + bar[cap_mark:]
    lines.append(f"  {'total':<12}{total / size:8.2f} {unit:<2}  {bar}  (| = {cap / 1e9:.1f} GB usable)")
    return lines


# what the buffers bar holds, as `Memory.detail` names it
BUFFER_PARTS = (
    ("logits", "logits"),
    ("weight_copies", "compute-dtype weight copies"),
    ("fsdp_gather", "FSDP's unsharded units"),
    ("recompute_working", "a recomputed layer"),
)


def _buffer_parts(detail: dict[str, float], total: float) -> list[str]:
    """One line naming what the buffers are, in the chart's unit (none where there are none)."""
    size, unit = byte_unit(total)
    parts = [
        f"{name} {detail[key] / size:.2f} {unit}" for key, name in BUFFER_PARTS if detail.get(key, 0) > 0
    ]
    return [f"  (buffers: {', '.join(parts)})"] if parts else []


def plan_text(p: Plan) -> str:
    lay = p.layout
    m = p.memory
    out = [
        f"{p.model.name} on {p.gpus} × {p.hardware.name} ({p.gpus_per_node} per node), block {p.arch.name}, "
        f"{count_words(p.params)} params",
        f"layout: dp {lay.dp} · fsdp {lay.fsdp} · cp {lay.cp} · tp {lay.tp} · pp {lay.pp} · ep {lay.ep}  "
        f"zero {lay.zero}  sp {'on' if lay.sp else 'off'}  recompute {lay.recompute_label}  "
        f"schedule {lay.pp_schedule} (v={lay.virtual_stages})",
        f"batch: {p.shape.global_batch} sequences × {p.shape.seq_len} tokens, "
        f"micro-batch {p.shape.micro_batch}, "
        f"{p.microbatches} micro-batch{'es' if p.microbatches != 1 else ''} per step; "
        f"{dtype_name(p.shape.act_bytes)}{' with fp8 linears' if p.shape.fp8 else ''}, "
        f"{'fused' if p.shape.fused else 'eager'} kernels",
        "",
        f"memory per GPU (worst rank: {m.stage} stage) — {fit_words(p.margin_bytes)}",
    ]
    out += memory_chart(
        {
            "params": m.params,
            "grads": m.grads,
            "optimizer": m.optimizer,
            "activations": m.activations,
            "buffers": m.buffers,
        },
        capacity(p.hardware),
        m.apart,
    )
    out += _buffer_parts(m.detail, m.total)
    if m.apart:
        out.append(
            f"  ({m.apart} left out of the total: one micro-batch a step, whose backward frees the "
            "activations as it builds the gradients)"
        )
    # a merged axis (fsdp_cp) or a long op name widens its column rather than running into the next
    axis_w = max([5] + [len(c.axis) + 1 for c in p.comm])
    op_w = max([16] + [len(c.op) + 1 for c in p.comm])
    out += [
        "",
        "communication per step (per rank)",
        f"  {'axis':<{axis_w}}{'op':<{op_w}}{'link':<7}{'group':>6}{'calls':>8}{'payload':>12}{'wire':>12}"
        f"{'time':>10}{'exposed':>10}",
    ]
    size, unit = byte_unit(max([c.bytes for c in p.comm] + [0.0]))
    for c in p.comm:
        out.append(
            f"  {c.axis:<{axis_w}}{c.op:<{op_w}}{c.link:<7}{c.group:>6}{c.count:>8}"
            f"{c.bytes / size:>10.2f}{unit:<2}{c.wire_bytes / size:>10.2f}{unit:<2}{c.time_s:>9.3f}s"
            f"{c.exposed_s:>9.3f}s"
        )
    if not p.comm:
        out.append("  (none: a single GPU)")
    out += [
        "",
        "time per step",
        f"  compute       {p.compute_time_s:10.3f} s"
        + (f"   (incl. {lay.recompute_label} recompute)" if lay.recompute != "none" else ""),
        f"  bubble        {p.bubble_time_s:10.3f} s   ({p.bubble_fraction:.1%} of the pipeline)",
        f"  exposed comm  {p.exposed_comm_s:10.3f} s",
        f"  optimizer     {p.optimizer_time_s:10.3f} s",
        f"  step          {p.step_time_s:10.3f} s   {p.tokens_per_s:,.0f} tokens/s",
        f"  model   {p.tflops_per_gpu:7.1f} TFLOP/s per GPU   MFU {p.mfu:.1%}  "
        f"(cross-validated band ±{MFU_BAND:.0%}: {p.mfu_band[0]:.1%}–{p.mfu_band[1]:.1%}; causal-half count: "
        f"{p.mfu_causal:.1%})",
        f"  hardware {p.hardware_tflops_per_gpu:6.1f} TFLOP/s per GPU   HFU {p.hfu:.1%}"
        + ("  (with recompute)" if lay.recompute != "none" else ""),
    ]
    out += [f"note: {n}" for n in p.notes]
    return "\n".join(out)


def search_text(result) -> str:
    out = [f"searched {result.considered} layouts, {result.fitting} fit, in {result.seconds:.2f} s", ""]
    from fivefold.plan.search import plan_flags

    out.append(f"  {'#':>2} {'step s':>9}{'MFU':>7}{'mem GB':>8}  layout")
    for i, p in enumerate(result.plans, start=1):
        row = f"  {i:>2} {p.step_time_s:>9.3f}{p.mfu:>7.1%}{p.memory.total / 1e9:>8.1f}"
        out.append(f"{row}  {plan_flags(p)}")
    out += [""] + result.explanation
    return "\n".join(out)


def inference_text(p) -> str:
    lay = p.layout
    out = [
        f"{p.model.name} serving on {lay.world} × {p.hardware.name}: "
        f"tp {lay.tp} · pp {lay.pp} · cp {lay.cp} · "
        f"ep {lay.ep} · {p.replicas} replica(s); batch {p.shape.batch}, context {p.shape.context}, "
        f"prompt {p.shape.prompt}; weights and KV cache in {dtype_name(p.shape.weight_bytes)}",
        "",
        f"memory per GPU — {fit_words(capacity(p.hardware) - p.total)}",
    ]
    out += memory_chart(
        {"params": p.weights, "activations": p.activations, "buffers": p.kv_cache}, capacity(p.hardware)
    )
    out[-2] = out[-2].replace("buffers ", "kv cache")
    out += [
        "",
        f"  prefill (time to first token) {p.prefill_time_s * 1e3:10.2f} ms",
        f"  decode per token              {p.decode_time_per_token_s * 1e3:10.2f} ms",
        f"  decode throughput             {p.decode_tokens_per_s:10,.0f} tokens/s (all replicas)"
        if p.fits
        else "  decode throughput                  — (does not fit: serves nothing)",
    ]
    out += _traffic_lines(p)
    if p.notes:
        out += ["", *(f"note: {note}" for note in p.notes)]
    return "\n".join(out)


def _traffic_lines(p) -> list[str]:
    """Collectives per decoded token on one rank of each distinct stage, with the time per axis."""
    traffic = p.traffic()
    keys = sorted({key for rows in traffic.values() for key in rows})
    if not keys:
        return []

    def cell(count: int, size: int) -> str:  # calls × bytes of each
        each = size / count
        return f"{count:g} × " + (f"{each:,.0f} B" if each < 1e3 else size_words(each))

    heads = [f"stage {s}" if p.layout.pp > 1 else "each rank" for s in traffic]
    out = ["", "collectives per decoded token (as fivefold generate --comm measures them)"]
    out.append(f"  {'axis':<5} {'op':<11} " + " ".join(f"{h:>16}" for h in heads) + f" {'axis time':>10}")
    timed: set[str] = set()
    for axis, op in keys:
        cells = [cell(*rows[axis, op]) if (axis, op) in rows else "-" for rows in traffic.values()]
        time = "" if axis in timed else f"{p.comm.get(axis, 0.0) * 1e3:.3f} ms"
        timed.add(axis)
        out.append(f"  {axis:<5} {op:<11} " + " ".join(f"{c:>16}" for c in cells) + f" {time:>10}")
    return out


def serving_search_text(result) -> str:
    """The ranked serving layouts of `plan --mode inference --search`."""
    out = [f"serving recipe ({result.objective}):"]
    out += [f"  · {line}" for line in result.explanation]
    out.append(
        f"{result.considered} layouts considered, {result.fitting} fit; best {len(result.plans)} by "
        f"{'decode time per token' if result.objective == 'latency' else 'decoded tokens/s'}:"
    )
    if not result.plans:
        out.append("  none fits: more GPUs, a smaller batch or context, or a bigger GPU")
        return "\n".join(out)
    out.append(f"  {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>3} {'replicas':>8} {'GB/GPU':>7} "
               f"{'TTFT ms':>9} {'ms/token':>9} {'tokens/s':>10}")  # fmt: skip
    for p in result.plans:
        lay = p.layout
        out.append(
            f"  {lay.tp:>3} {lay.pp:>3} {lay.cp:>3} {lay.ep:>3} {p.replicas:>8} {p.total / 1e9:>7.1f} "
            f"{p.prefill_time_s * 1e3:>9.2f} {p.decode_time_per_token_s * 1e3:>9.2f} "
            f"{p.decode_tokens_per_s:>10,.0f}"
        )
    return "\n".join(out)
