"""What one rank of a concrete run does in one step, as the per-axis planners see it.

`RunShape` is the run (model, layout, batch, dtype), `Chunk` a piece of the model a rank holds
(pipeline chunks; the whole model without pipelining), `Traffic` the collectives of one step
by (axis, op) with their call count and bytes, named as the comm ledger names them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from fivefold.config import Layout, ModelSpec, recomputed_blocks
from fivefold.layout_math import rank_stages, replica_wrapper, stage_split

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def dtype_name(width: int) -> str:
    """The `--dtype` of `width`-byte compute elements (DTYPE_BYTES read backwards; 16 bits: bf16)."""
    return "fp32" if width == DTYPE_BYTES["fp32"] else "bf16"


def fsdp_sync_deferred(layout: Layout) -> bool:
    """Whether FSDP's gradients sync once a step instead of every micro-batch: torch's pipeline stage
    defers the sync to its last backward. The ledger (`RunShape.fsdp_syncs`) and the time model
    (`plan.dataparallel`) both ask here."""
    return layout.pp > 1


@dataclass(frozen=True)
class Chunk:
    stage: int
    layers: tuple[int, ...]
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the head and the loss


@dataclass(frozen=True)
class RunShape:
    spec: ModelSpec
    layout: Layout
    micro_batch: int
    seq_len: int
    microbatches: int  # micro-batches per data-parallel rank per step
    dtype: str = "fp32"

    @property
    def act_bytes(self) -> int:
        """Bytes per element of activations: bf16 runs compute (and communicate) in 2 bytes."""
        return DTYPE_BYTES[self.dtype]

    @property
    def autocast(self) -> bool:
        """bf16 by autocast over fp32 weights; FSDP and `replicate` (tp with replicas) cast the
        weights themselves (their mixed-precision policy)."""
        return self.dtype == "bf16" and replica_wrapper(self.layout) not in ("fsdp", "replicate")

    @property
    def stream_bytes(self) -> int:
        """Bytes per element of the residual stream (and rotary q, k): fp32 under autocast, whose
        bf16 matmul outputs are added to fp32 embeddings."""
        return 4 if self.autocast else self.act_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes per element of the weights the step computes with, and of their gradients until
        FSDP casts them for its reduction: 2 where a mixed-precision policy casts the weights (FSDP,
        `replicate`), 4 under autocast (fp32 weights) and in fp32."""
        return 4 if self.autocast else self.act_bytes

    @property
    def fsdp_syncs(self) -> int:
        """FSDP gradient reductions a step: every micro-batch's (the runner keeps FSDP's gradients
        sharded), except in a pipeline, whose stage defers them to its last backward."""
        return 1 if fsdp_sync_deferred(self.layout) else self.microbatches

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (its sequence shard under cp)."""
        return self.micro_batch * self.seq_len // self.layout.cp

    def again(self, chunks: list[Chunk]) -> list[int]:
        """Layers of `chunks` whose forward full recompute runs a second time in the backward."""
        lay = self.layout
        return [
            i
            for c in chunks
            for i in c.layers[: recomputed_blocks(lay.recompute, lay.recompute_layers, len(c.layers))]
        ]

    def split(self) -> list[int]:
        if self.layout.pp == 1:
            return [self.spec.layers]
        return stage_split(self.spec, self.layout, self.seq_len)

    def chunks(self, pp_rank: int) -> list[Chunk]:
        """The chunks pp rank `pp_rank` runs."""
        lay = self.layout
        counts = self.split()
        starts = [sum(counts[:k]) for k in range(len(counts))]
        last = len(counts) - 1
        stages = rank_stages(pp_rank, lay.pp, lay.virtual_stages, lay.pp_schedule) if lay.pp > 1 else [0]
        return [Chunk(s, tuple(range(starts[s], starts[s] + counts[s])), s == 0, s == last) for s in stages]


@dataclass
class Traffic:
    """(axis, op) -> [calls, bytes] of one step on one rank."""

    rows: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def add(self, axis: str | None, op: str, calls: int, nbytes: int) -> None:
        """`calls` collectives of `nbytes` each (nothing when the axis has one rank)."""
        if axis is None or calls <= 0:
            return
        row = self.rows[(axis, op)]
        row[0] += calls
        row[1] += calls * nbytes

    def merge(self, other: Traffic) -> Traffic:
        for (axis, op), (calls, nbytes) in other.rows.items():
            row = self.rows[(axis, op)]
            row[0] += calls
            row[1] += nbytes
        return self

    def as_dict(self) -> dict[tuple[str, str], tuple[int, int]]:
        return {k: (c, b) for k, (c, b) in self.rows.items() if c}
