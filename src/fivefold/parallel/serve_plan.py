"""The plan of a serving job, rank by rank: what `fivefold generate --comm` prints beside the ledger and
`--verify` judges. Each function asks the planner (`fivefold.plan.inference`) for one rank of a
`ServeJob`, from the same facts the planner takes: the layout, the rank's stage, replica and cp
rank, the prompts its replica (and its ep peers) serve, the steps it took and its dtype.
"""

from __future__ import annotations

from typing import Any

from fivefold.config import Layout

# a `fivefold.parallel.serve.ServeJob` (not imported: serve imports this module)
ServeJob = Any


def planned_traffic(
    job: ServeJob, stage: int, replica: int, cp_rank: int, act_bytes: int, prefill: bool, steps: int
) -> list[dict]:
    """The planner's collectives of one rank (`plan.inference.decode_traffic`) in the prefill or per
    decoded token, as ledger rows, for the prompts its replica (and its ep peers) serve; none where
    its replica took no such step (every limit 0, or nothing past the prefill)."""
    from fivefold.plan.inference import decode_traffic

    if steps <= (0 if prefill else 1):
        return []

    def served(replica: int) -> tuple[int, int]:  # (prompts, left-padded width) of a replica
        mine = job.prompts[replica :: job.dp]
        return len(mine), max(len(p) for p in mine)

    def tokens(member: int) -> float:  # rows a rank of the flattened replicas×cp (cp inner) runs
        batch, width = served(member // job.cp)
        if not prefill:
            return batch  # the new token, on every cp rank
        return batch * (width + -width % (2 * job.cp)) / job.cp if job.cp > 1 else batch * width

    batch, width = served(replica)
    first = (replica * job.cp + cp_rank) // job.ep * job.ep  # ep: the innermost of replicas×cp
    peer_tokens = sum(tokens(m) for m in range(first, first + job.ep))
    layout = Layout(dp=job.dp, tp=job.tp, pp=job.pp, cp=job.cp, ep=job.ep)
    rows = decode_traffic(
        job.source.spec(), layout, batch, stage, act_bytes, cp_rank == 0, width if prefill else 0,
        peer_tokens / job.ep,
    )  # fmt: skip
    return [{"axis": a, "op": op, "count": c, "bytes": b} for (a, op), (c, b) in sorted(rows.items())]


def planned_weights(job: ServeJob, stage: int, act_bytes: int) -> int:
    """The planner's weight bytes on a rank of this stage (`plan.inference.rank_weights`)."""
    from fivefold.plan.inference import rank_weights

    layout = Layout(dp=job.dp, tp=job.tp, pp=job.pp, cp=job.cp, ep=job.ep)
    return rank_weights(job.source.spec(), layout, stage) * act_bytes


def planned_cache(job: ServeJob, steps: int, stage: int, replica: int, cp_rank: int, act_bytes: int) -> int:
    """The planner's KV-cache bytes of one rank after `steps` decoding steps of its replica's prompts
    (`plan.inference.kv_bytes_per_token` over the stage's layers and the columns it caches)."""
    from fivefold.layout_math import stage_split
    from fivefold.plan.inference import cached_columns, kv_bytes_per_token

    spec = job.source.spec()
    layout = Layout(dp=job.dp, tp=job.tp, pp=job.pp, cp=job.cp, ep=job.ep)
    layers = stage_split(spec, layout, spec.max_seq_len)[stage] if job.pp > 1 else spec.layers
    mine = job.prompts[replica :: job.dp]
    columns = cached_columns(max(len(p) for p in mine), steps, job.cp, cp_rank)
    return int(kv_bytes_per_token(spec, layout, act_bytes) * layers * len(mine) * columns)
