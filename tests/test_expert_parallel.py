"""Expert parallelism against the single-process model, and its all-to-alls in the comm ledger.

One spawn of 4 gloo ranks runs every layout in turn; each trains 3 AdamW steps (2 micro-batches
per data rank, clipping active) from the same seeded weights and global batches as the single
process, and must give the same losses (1e-5 relative) and the same updated parameters (1e-5
absolute, as the layout matrix). The ledger of one step's forward and backward must equal the
sharding rules' count (tests/parallel_theory.py) on every rank: the token all-to-alls on `ep` with
exactly the bytes the routing implies (per MoE layer and micro-batch, the rows sent out and the
rows received back in forward, the same again in backward, hidden × 4 bytes each, plus the [E]
int64 count exchange of each forward), the experts' FSDP over expert_fsdp, and the rest's FSDP.
"""

from __future__ import annotations

import pytest

from fivefold.config import TrainSpec
from harness import Batch, Case, Tolerance, assert_matches

WORLD = 4
STEPS = 3
ACCUMULATION = 2
TRAIN = TrainSpec(seq_len=16, micro_batch=2, lr=1e-3, eps=1e-6, grad_clip=0.3, seed=5)
TOLERANCE = Tolerance(loss_rel=1e-5, param_abs=1e-5, first_norm_rel=1e-6)
LEDGER_STEP = 1

LAYOUTS = [
    ("tiny-moe", dict(fsdp=2, dp=2, ep=2)),
    ("tiny-moe", dict(fsdp=4, ep=2)),  # expert_fsdp 2
    ("aux", dict(fsdp=4, ep=4)),  # the sequence-wise auxiliary loss on: its gradient reaches the router
    ("tiny-moe", dict(fsdp=4, ep=4, zero=3)),
]
CASES = Batch(
    [Case(m, lay, WORLD, TRAIN, STEPS, ACCUMULATION, ledger_steps=(LEDGER_STEP,)) for m, lay in LAYOUTS],
    timeout=300,
)
IDS = [c.id.removeprefix(f"w{WORLD}-") for c in CASES.cases]


def test_received_rows_are_regrouped_by_local_expert() -> None:
    """Rows arrive by source rank, then local expert; the experts want them by local expert, then
    source rank, and the combine puts them back."""
    import torch

    from fivefold.parallel.expert import _by_local_expert, _inverse

    recv = torch.tensor([[2, 1, 0], [0, 3, 1], [1, 0, 2]])  # [source rank, local expert]
    arrived = [(r, e) for r in range(3) for e in range(3) for _ in range(int(recv[r, e]))]
    order = _by_local_expert(recv, len(arrived))
    by_expert = sorted(range(len(arrived)), key=lambda i: (arrived[i][1], arrived[i][0]))  # stable
    assert order.tolist() == by_expert
    assert torch.equal(order[_inverse(order)], torch.arange(len(arrived)))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES.cases, ids=IDS)
def test_matches_single_process(case: Case) -> None:
    assert_matches(case, CASES.ranks(case), TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES.cases, ids=IDS)
def test_ledger_matches_theory(case: Case) -> None:
    """Every collective of one step's forward and backward on every rank, against the sharding
    rules (tests/parallel_theory.py): the token all-to-alls on `ep` with the bytes the routing
    implies, the experts' FSDP on expert_fsdp and their dp all-reduces, the rest's FSDP."""
    from parallel_theory import expected_forward_backward

    spec = case.spec()
    layout, _, _ = case.resolve()
    moe = sum(spec.is_moe_layer(i) for i in range(spec.layers))
    sent = moe * ACCUMULATION * TRAIN.micro_batch * TRAIN.seq_len * spec.experts_per_token
    ranks = CASES.ranks(case)
    [received] = zip(*(r["received"] for r in ranks))  # the ledger step's rows, by rank
    assert sum(received) == sent * WORLD  # every routed row lands somewhere
    for rank, r in enumerate(ranks):
        [(fwd_bwd, _)] = r["ledger"]
        got = {(row["axis"], row["op"]): (row["count"], row["bytes"]) for row in fwd_bwd}
        theory = expected_forward_backward(
            spec, layout, TRAIN.micro_batch, TRAIN.seq_len, ACCUMULATION, received=received[rank]
        )
        assert got == theory, (rank, {k: (got.get(k), theory.get(k)) for k in got.keys() | theory.keys()})
