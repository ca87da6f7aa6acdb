"""Pipeline parallelism: split the model into stages and run torch's schedules over them.

`torch.distributed.pipelining` provides the stages and the schedules (GPipe, 1F1B, Interleaved1F1B,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); this module decides *where* to cut the model, builds
only this rank's pieces, composes them with the other axes and turns a schedule into a `StepRunner`.

* **Split.** `pp × virtual_stages` chunks of consecutive layers, balanced by cost: each layer costs its
  forward FLOPs per token; the first chunk also pays for the embedding, the last one for the final norm,
  the output head and the loss (the head's vocab × hidden matmul is often worth several layers of a
  small model). `--pp-split 3,5,5,3` overrides the balance.
* **Placement.** Chunk c runs on pp rank c mod pp ("loop" order) except for the V-shaped schedules
  (zbv, dualpipev): rank r holds chunks r and 2·pp−1−r, so the first and the last chunk share rank 0.
* **Build.** Each chunk is a `Transformer` built on the meta device with the layers it does not own
  deleted (names, hence init seeds and checkpoint keys, are kept) and `embed_tokens`/`norm`/`lm_head`
  set to None where another chunk holds them; TP/FSDP come from `parallelize_chunk`, then only these
  parameters are materialised with the model's per-name seeded init.
* **Losses and gradients.** The last stage computes lm_loss / m per micro-batch and the schedule does not
  rescale (scale_grads=False), so gradients are those of the mean loss, and the MoE auxiliary loss,
  attached inside the forward, is scaled by 1/m like the rest. The mean loss is broadcast from the last
  stage over `pp` and averaged over the data-parallel ranks: every rank reports it.
"""

from __future__ import annotations

from collections.abc import Sequence

from fivefold.config import Layout, ModelSpec, TrainSpec
from fivefold.errors import FivefoldError, divisors, suggest

# the split and the placement are shared with the planner (torch-free); re-exported here
from fivefold.layout_math import (  # noqa: F401
    SINGLE_STAGE,
    SPLIT_BACKWARD,
    V_SHAPED,
    StageCosts,
    balanced_split,
    parse_split,
    rank_stages,
    stage_costs,
    stage_split,
    stage_to_rank,
)

#: our schedule names -> torch.distributed.pipelining class names
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def check_pipeline(spec: ModelSpec, layout: Layout, train: TrainSpec | None = None) -> list[int]:
    """Validate a pipelined layout against the model (and batch); return the layers per chunk."""
    pp, v, m, sched = layout.pp, layout.virtual_stages, layout.microbatches, layout.pp_schedule
    chunks = pp * v
    if pp > spec.layers:
        raise FivefoldError(
            f"--pp {pp} exceeds the {spec.layers} layers of {spec.name}: every stage needs a layer; "
            f"valid pp: {suggest(range(1, spec.layers + 1))}"
        )
    if sched in SINGLE_STAGE and v != 1:
        raise FivefoldError(
            f"--pp-schedule {sched} runs one chunk per rank, got --virtual-stages {v}; use "
            "--virtual-stages 1 or an interleaved schedule (interleaved-1f1b, zero-bubble)"
        )
    if sched in V_SHAPED and v != 2:
        raise FivefoldError(
            f"--pp-schedule {sched} folds exactly 2 chunks per rank into a V; use --virtual-stages 2"
        )
    if chunks > spec.layers:
        ok = [d for d in range(1, spec.layers // pp + 1)]
        raise FivefoldError(
            f"--pp {pp} × --virtual-stages {v} = {chunks} chunks exceeds the {spec.layers} layers of "
            f"{spec.name}; valid virtual stages for pp {pp}: {suggest(ok)}"
        )
    if not layout.pp_split and v > 1 and spec.layers % chunks:
        ok = [d for d in divisors(spec.layers) if d % pp == 0]
        raise FivefoldError(
            f"--virtual-stages {v} with --pp {pp} makes {chunks} chunks, which does not divide the "
            f"{spec.layers} layers of {spec.name} (interleaved chunks must be alike); valid virtual stages: "
            f"{suggest([d // pp for d in ok]) or 'none'}, or give --pp-split"
        )
    _check_microbatches(pp, m, sched)
    if spec.tie_embeddings:
        raise FivefoldError(
            f"{spec.name} ties the embedding and the output head, which pipelining puts on different stages; "
            "use a model with tie_embeddings = false, or --pp 1"
        )
    if layout.cp > 1:
        raise FivefoldError("--pp with --cp is not supported yet; use --cp 1 with pipelining")
    if layout.fsdp > 1 and layout.zero == 3 and sched in SPLIT_BACKWARD:
        # the weight-gradient pass walks the autograd graph from the module's parameters; with ZeRO-3
        # FSDP has swapped the gathered ones used in the forward back for shards by then
        raise FivefoldError(
            f"--pp-schedule {sched} computes weight gradients after the input gradients, which needs "
            f"FSDP's gathered parameters kept from forward to backward: use --zero 2 with --fsdp "
            f"{layout.fsdp}, or a schedule without the split (gpipe, 1f1b, interleaved-1f1b)"
        )
    if train is not None:
        local = train.micro_batch * train.grad_accum(layout.data_parallel)
        if local % m:
            ok = [d for d in divisors(local) if d >= _min_microbatches(pp, sched)]
            raise FivefoldError(
                f"each data-parallel rank's batch of {local} sequences (micro_batch × accumulation) does not "
                f"divide into --microbatches {m}; valid microbatches: {suggest(ok) or 'none'}"
            )
    return stage_split(spec, layout, train.seq_len if train else spec.max_seq_len)


def _min_microbatches(pp: int, schedule: str) -> int:
    if schedule == "gpipe":
        return 1
    if schedule == "dualpipev":
        return 2 * pp  # at least one micro-batch per chunk
    return pp  # 1F1B and the interleaved family fill the pipeline before the steady state


def _check_microbatches(pp: int, m: int, schedule: str) -> None:
    need = _min_microbatches(pp, schedule)
    if m < need:
        raise FivefoldError(
            f"--pp-schedule {schedule} needs at least {need} micro-batches with --pp {pp}, got "
            f"--microbatches {m}; valid: {suggest([need * k for k in range(1, 5)])} or more"
        )
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            ok = [x for x in range(pp, 4 * pp + 1) if x % max(1, x // pp) == 0]
            raise FivefoldError(
                f"--pp-schedule {schedule} runs micro-batches in rounds of {pp}: --microbatches {m} must "
                f"be a multiple of m // pp = {rounds}; valid: {suggest(ok)}"
            )


# --------------------------------------------------------------------------------------------
# torch from here on (imported lazily so the planner and the CLI stay light)


def build_chunk(model, layers: Sequence[int], first: bool, last: bool):
    """A meta-device copy of `model` holding only `layers` (and the embedding/head if first/last)."""
    from fivefold.model import build_model

    chunk = build_model(model.spec, device="meta")
    keep = {str(i) for i in layers}
    for name in list(chunk.model.layers.keys()):
        if name not in keep:
            del chunk.model.layers[name]
    if not first:
        chunk.model.embed_tokens = None
    if not last:
        chunk.model.norm = None
        chunk.lm_head = None
    return chunk


def _copy_from(chunk, source) -> None:
    """Fill a materialised chunk from an already materialised full model (same names)."""
    import torch

    from fivefold.model.transformer import _copy_into

    full = dict(source.named_parameters()) | dict(source.named_buffers())
    with torch.no_grad():
        for name, tensor in list(chunk.named_parameters()) + list(chunk.named_buffers()):
            if name in full:
                _copy_into(tensor, full[name].detach())


def build_pipeline_runner(model, runtime_mesh, layout: Layout, train: TrainSpec):
    """The `StepRunner` for a layout with pp > 1 (see fivefold.parallel.api)."""
    from fivefold.model import materialize
    from fivefold.parallel.pipeline_runner import PipelineRunner
    from fivefold.parallel.precision import precision_mode

    counts = check_pipeline(model.spec, layout, train)
    pp, sched = layout.pp, layout.pp_schedule
    chunks_total = pp * layout.virtual_stages
    starts = [sum(counts[:k]) for k in range(chunks_total)]
    device = _device(runtime_mesh, train)
    pp_rank = runtime_mesh.coord("pp")
    source_is_meta = any(p.is_meta for p in model.parameters())
    parts, modules, stage_ids = [], [], rank_stages(pp_rank, pp, layout.virtual_stages, sched)
    for s in stage_ids:
        chunk = build_chunk(model, range(starts[s], starts[s] + counts[s]), s == 0, s == chunks_total - 1)
        module = _parallelize(chunk, runtime_mesh, layout, train)  # materialises it when it shards
        if any(p.is_meta for p in chunk.parameters()):
            materialize(chunk, device, train.seed)
        if not source_is_meta:
            _copy_from(chunk, model)
        parts.append(chunk)
        autocast = precision_mode(train.dtype, layout) == "autocast"
        modules.append(_with_autocast(module, device) if autocast else module)
    return PipelineRunner(parts, modules, stage_ids, counts, runtime_mesh, layout, device, train)


def _parallelize(chunk, runtime_mesh, layout: Layout, train: TrainSpec):
    """TP(+SP), recompute and FSDP on one chunk; returns the module the stage calls.

    Plain replicas (dp without fsdp or tp) are not wrapped in DDP, whose reducer does not survive
    the schedules' split backward: the runner averages those gradients over `dp` after the step.
    """
    if layout.tp == 1 and layout.fsdp == 1:
        if layout.recompute != "none":
            from fivefold.parallel.recompute import apply_recompute

            apply_recompute(chunk, layout.recompute)
        if train.compile:
            from fivefold.parallel.compile import compile_blocks

            compile_blocks(chunk)
        return chunk
    from fivefold.parallel.apply import parallelize_chunk

    return parallelize_chunk(chunk, runtime_mesh, layout, train)


def _with_autocast(module, device):
    """bf16 by autocast (see fivefold.parallel.precision): entered inside the stage's module, so
    the schedule's own forwards (and its shape inference) see bf16 activations."""
    import torch
    from torch import nn

    class Autocast(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return self.inner(*args, **kwargs)

    return Autocast(module)


def _device(runtime_mesh, train: TrainSpec):
    import torch

    kind = runtime_mesh.device_mesh.device_type
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)
