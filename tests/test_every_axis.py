"""Every axis with every other: layouts that mix dp, fsdp, tp+sp, pp, cp and ep train exactly as the
single process does, and everything the planner's search proposes passes `train`'s validation.

One spawn per world size (4, 8, 16) runs all its layouts for a step or two on tiny models, dense
and MoE. The pairs of {dp, fsdp, tp+sp, pp, cp, ep} each appear in a 4- or 8-rank layout:

  A  dp·fsdp·cp + ep      dp-fsdp dp-cp dp-ep fsdp-cp fsdp-ep cp-ep
  B  dp·tp·pp             dp-tp dp-pp tp-pp
  C  tp·cp·pp + ep        tp-cp tp-ep pp-cp pp-ep (ulysses, interleaved 1F1B)
  D  fsdp·tp·pp + ep      fsdp-tp fsdp-pp (zbv, ZeRO-2)

Each cp core runs inside a pipeline at least once (ring in the 5D run, ulysses in C, all-gather in
E), each schedule at least once with cp or ep, and tied embeddings are pipelined under 1F1B and
interleaved 1F1B. Checks: the loss within 1e-5 relative on every rank, every updated parameter
within 1e-5 absolute, a tied head equal to its embedding, and each rank's expert bytes equal to its
experts' weights / (ep × expert_fsdp) (experts are FSDP-sharded over expert_fsdp when fsdp is used).
"""

from __future__ import annotations

import pytest

from fivefold.config import TrainSpec, load_hardware, load_model
from fivefold.plan import TrainShape
from fivefold.plan.search import search
from fivefold.support import check_microbatches, check_trainable
from harness import Batch, Case, Tolerance, assert_matches

STEPS = 2
TRAIN = TrainSpec(seq_len=16, micro_batch=2, lr=1e-3, eps=1e-6, grad_clip=0.3, seed=3)
TOLERANCE = Tolerance(loss_rel=1e-5, param_abs=1e-5)
INTERLEAVED = dict(pp_schedule="interleaved-1f1b", virtual_stages=2)
FIVE_D = ("tiny-moe", dict(pp=2, fsdp=2, tp=2, cp=2, ep=2, sp=True))
LAYOUTS: dict[int, list[tuple[str, dict]]] = {
    4: [
        ("tiny", dict(pp=2, cp=2, cp_impl="allgather", pp_schedule="gpipe")),  # E
        ("tiny", dict(pp=2, cp=2, pp_schedule="zero-bubble")),
        ("tiny-moe", dict(pp=2, cp=2, ep=2, pp_schedule="dualpipev", microbatches=4)),
        ("tied", dict(pp=2, cp=2, pp_schedule="interleaved-1f1b", virtual_stages=2)),
        ("tied", dict(pp=2, dp=2)),  # 1F1B
    ],
    8: [
        ("tiny-moe", dict(dp=2, fsdp=2, cp=2, ep=2, cp_impl="allgather")),  # A
        ("tiny", dict(dp=2, tp=2, pp=2, sp=True)),  # B
        ("tiny-moe", dict(tp=2, cp=2, pp=2, ep=2, sp=True, cp_impl="ulysses", **INTERLEAVED)),  # C
        ("tiny-moe", dict(fsdp=2, tp=2, pp=2, ep=2, sp=True, zero=2, pp_schedule="zbv")),  # D
    ],
    16: [FIVE_D],
}
# one pipeline micro-batch of `micro_batch` rows per data-parallel rank, or two accumulation steps
# without a pipeline; the ledger and the experts' received rows of every step
CASES = Batch(
    [
        Case(m, lay, world, TRAIN, STEPS, None if "pp" in lay else 2, ledger_steps=tuple(range(STEPS)))
        for world, layouts in LAYOUTS.items()
        for m, lay in layouts
    ],
    timeout=600,
)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES.cases, ids=[c.id for c in CASES.cases])
def test_matches_single_process(case: Case) -> None:
    from harness import reference

    ranks = CASES.ranks(case)
    assert_matches(case, ranks, TOLERANCE)
    params: dict = {}
    for r in ranks:
        params.update(r["params"] or {})
    if case.model == "tied":  # the last stage's head stayed equal to the first stage's embedding
        assert (params["lm_head.weight"] - params["model.embed_tokens.weight"]).abs().max() <= 1e-6
    layout, _, _ = case.resolve()
    ref = reference(case)
    expert_fsdp = layout.fsdp * layout.cp // layout.ep if layout.fsdp > 1 else 1
    for r in ranks:
        full = sum(ref.params[n].numel() * 4 for n in r["names"] if ".experts." in n)
        assert r["expert_bytes"] == full // (layout.ep * expert_fsdp)


@pytest.mark.slow
def test_five_d_step_ledger_matches_theory() -> None:
    """The 5D run's last step (the first also exchanges the stages' shapes), rank by rank, against
    the sharding rules (tests/parallel_theory.py): the token all-to-alls on `ep` with the bytes the
    rank's routing implies, the experts' FSDP gathers on expert_fsdp (their parameter bytes over
    the shards), and the stage hand-overs on `pp` (one activation per micro-batch each way)."""
    from fivefold.mesh import build_mesh
    from fivefold.plan.runshape import RunShape
    from parallel_theory import expected_expert_parallel, expected_stage_p2p

    [case] = [c for c in CASES.cases if c.world == 16]
    spec = case.spec()
    layout, train, _ = case.resolve()
    mb, seq, m = train.micro_batch, train.seq_len, layout.microbatches
    info = build_mesh(layout, 16, 16)
    ranks = CASES.ranks(case)
    sent = 0
    for rank, r in enumerate(ranks):
        got = _whole_step(*r["ledger"][STEPS - 1])
        pp_rank = info.ranks[rank].coords["pp"]
        layers = [i for chunk in RunShape(spec, layout, mb, seq, m).chunks(pp_rank) for i in chunk.layers]
        theory = expected_expert_parallel(spec, layout, mb, seq, m, r["received"][STEPS - 1], layers)
        theory |= expected_stage_p2p(spec, layout, mb, seq, m, pp_rank)
        # the experts' gradients are reduce-scattered once a step (the stage calls the FSDP module
        # itself, so torch's stage skips the sync for all but the last micro-batch)
        keys = [("ep", "all_to_all"), ("expert_fsdp", "reduce_scatter"), ("pp", "send"), ("pp", "recv")]
        for key in keys:
            assert got[key] == theory[key], (rank, key, got[key], theory[key])
        # ZeRO-3 inside a pipeline: torch's stage keeps a unit gathered from a backward to the next
        # forward, so how many gathers a step makes depends on the schedule's order of forwards
        # and backwards; each gather moves a whole unit, and never more often than twice per
        # micro-batch
        calls, nbytes = got[("expert_fsdp", "all_gather")]
        most, most_bytes = theory[("expert_fsdp", "all_gather")]
        assert 0 < calls <= most and nbytes * most == most_bytes * calls, (rank, calls, most)
        sent += m * sum(spec.is_moe_layer(i) for i in layers) * mb * seq // layout.cp * spec.experts_per_token
    # every row routed in the step landed on some rank's experts
    assert sum(r["received"][STEPS - 1] for r in ranks) == sent


def _whole_step(fwd_bwd: list[dict], optimizer_phase: list[dict]) -> dict[tuple[str, str], tuple[int, int]]:
    """(axis, op) -> (count, bytes) over a step's forward + backward and optimizer phases."""
    got: dict[tuple[str, str], tuple[int, int]] = {}
    for row in fwd_bwd + optimizer_phase:
        count, nbytes = got.get((row["axis"], row["op"]), (0, 0))
        got[(row["axis"], row["op"])] = (count + row["count"], nbytes + row["bytes"])
    return got


SEARCHES = [
    ("llama3-405b", 16384, 8192, 2048),
    ("mixtral-8x7b", 64, 4096, 256),
    ("qwen3-30b-a3b", 64, 4096, 256),
    ("deepseek-v3", 2048, 4096, 2048),
]


@pytest.mark.parametrize(("name", "gpus", "seq", "batch"), SEARCHES, ids=[s[0] for s in SEARCHES])
def test_train_accepts_what_the_search_proposes(name: str, gpus: int, seq: int, batch: int) -> None:
    model = load_model(name)
    shape = TrainShape(seq_len=seq, global_batch=batch)
    result = search(model, load_hardware("h100-80gb"), gpus, shape, top=5)
    assert len(result.plans) == 5
    for p in result.plans:
        check_trainable(model, p.layout, seq)  # raises on a refusal
        if p.layout.pp > 1:
            check_microbatches(p.layout.pp, p.microbatches, p.layout.pp_schedule)
    if name != "llama3-405b":  # the MoE models' best layouts combine ep with pp or cp
        assert any(p.layout.ep > 1 and (p.layout.pp > 1 or p.layout.cp > 1) for p in result.plans)
