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
from fivefold.support import check_microbatches, check_trainable, pipeline_micro_batch

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
    check_trainable(spec, layout, train.seq_len if train else None)
    check_microbatches(layout.pp, layout.microbatches, layout.pp_schedule)
    if train is not None:
        check_pipeline_batch(layout, train)
    return stage_split(spec, layout, train.seq_len if train else spec.max_seq_len)


def check_pipeline_batch(layout: Layout, train: TrainSpec) -> None:
    """Each data-parallel rank's batch must split into the schedule's micro-batches."""
    pipeline_micro_batch(layout, train.micro_batch * train.grad_accum(layout.data_parallel))


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
    if source.spec.tie_embeddings:  # the shared weight is listed once, under the embedding's name
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    with torch.no_grad():
        for name, tensor in list(chunk.named_parameters()) + list(chunk.named_buffers()):
            if name in full:
                _copy_into(tensor, full[name].detach())
