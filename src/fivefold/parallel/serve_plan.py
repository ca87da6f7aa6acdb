"""The plan of a serving job, rank by rank: what `fivefold generate --comm` prints beside the ledger and
`--verify` judges. Each function asks the planner (`fivefold.plan.inference`) for one rank of a
`ServeJob`, from the same facts the planner takes: the layout, the rank's stage, replica and cp
rank, the prompts its replica (and its ep peers) serve, the steps it took and its dtype.
"""

from __future__ import annotations

from typing import Any

from fivefold.config import Layout, ModelSpec

# a `fivefold.parallel.serve.ServeJob` (not imported: serve imports this module)
ServeJob = Any


def plan_layout(job: ServeJob) -> Layout:
    """The layout the planner takes for a serving job (its tp, pp, cp and ep; dp the replicas)."""
    return Layout(dp=job.dp, tp=job.tp, pp=job.pp, cp=job.cp, ep=job.ep)


def planned_traffic(
    job: ServeJob,
    spec: ModelSpec,
    stage: int,
    replica: int,
    cp_rank: int,
    act_bytes: int,
    prefill: bool,
    steps: int,
) -> list[dict]:
    """The planner's collectives of one rank (`plan.inference.decode_traffic`) in the prefill or per
    decoded token, as ledger rows, for the prompts its replica (and its ep peers) serve; none where
    its replica took no such step (every limit 0, or nothing past the prefill)."""
    from fivefold.layout_math import cp_prefill_width
    from fivefold.plan.inference import decode_traffic

    if steps <= (0 if prefill else 1):
        return []

    def served(replica: int) -> tuple[int, int]:  # (prompts, left-padded width) of a replica
        mine = job.prompts[replica :: job.dp]
        return len(mine), max(len(p) for p in mine)

    def tokens(member: int) -> float:  # rows a rank of the flattened replicas×cp (cp inner) runs
        batch, width = served(member // job.cp)
        return batch * cp_prefill_width(width, job.cp) / job.cp if prefill else batch

    batch, width = served(replica)
    first = (replica * job.cp + cp_rank) // job.ep * job.ep  # ep: the innermost of replicas×cp
    peer_tokens = sum(tokens(m) for m in range(first, first + job.ep))
    rows = decode_traffic(
        spec, plan_layout(job), batch, stage, act_bytes, cp_rank == 0, width if prefill else 0,
        peer_tokens / job.ep,
    )  # fmt: skip
    return [{"axis": a, "op": op, "count": c, "bytes": b} for (a, op), (c, b) in sorted(rows.items())]


def planned_weights(job: ServeJob, spec: ModelSpec, stage: int, act_bytes: int) -> int:
    """The planner's weight bytes on a rank of this stage (`plan.inference.rank_weights`)."""
    from fivefold.plan.inference import rank_weights

    return rank_weights(spec, plan_layout(job), stage) * act_bytes


def planned_cache(
    job: ServeJob, spec: ModelSpec, steps: int, stage: int, replica: int, cp_rank: int, act_bytes: int
) -> int:
    """The planner's KV-cache bytes of one rank after `steps` decoding steps of its replica's prompts
    (`plan.inference.kv_bytes_per_token` over the stage's layers and the columns it caches)."""
    from fivefold.plan.inference import cached_columns, kv_bytes_per_token, stage_layers

    layout = plan_layout(job)
    layers = len(stage_layers(spec, layout, stage))
    mine = job.prompts[replica :: job.dp]
    columns = cached_columns(max(len(p) for p in mine), steps, job.cp, cp_rank)
    return int(kv_bytes_per_token(spec, layout, act_bytes) * layers * len(mine) * columns)
