"""Context parallelism against the single-process model, and the cp traffic against its arithmetic.

One spawned 4-rank gloo group trains every case for a few AdamW steps from the same seeded
weights and global batches as the single-process reference computed here (2 micro-batches per
data-parallel rank, global-norm clipping active). Each case checks:
  * losses within 1e-5 relative at every step, the step-0 gradient norm within 1e-6, gathered
    parameters after the last step within 1e-5 absolute (the layout tests' tolerances);
  * the ledger's rows on axis `cp` for one step's forward + backward equal what the impl moves:
    allgather gathers K and V of every layer (backward reduce-scatters their gradients), ring
    passes them (and in backward their gradients) from rank to rank with send/recv,
    ulysses sends q, k, v and the output through all-to-all both ways; MoE layers add one small
    all-reduce of whole-sequence router statistics each way.
"""

from __future__ import annotations

import pytest
import torch

from fivefold.config import Layout, ModelSpec, TrainSpec
from harness import Batch, Case, Tolerance, assert_matches
from parallel_theory import expected_forward_backward

STEPS = 3
ACCUMULATION = 2
TRAIN = TrainSpec(seq_len=16, micro_batch=2, lr=1e-3, eps=1e-6, grad_clip=0.3, seed=5)
TOLERANCE = Tolerance(loss_rel=1e-5, param_abs=1e-5, first_norm_rel=1e-6, norm_rel=1e-4)
LEDGER_STEP = 1
WORLD = 4
F32 = 4

LAYOUTS: list[tuple[str, dict]] = [
    ("tiny", dict(dp=2, cp=2, cp_impl="ring")),
    ("tiny", dict(dp=2, cp=2, cp_impl="allgather")),
    ("tiny", dict(dp=2, cp=2, cp_impl="ulysses")),
    ("tiny", dict(cp=2, fsdp=2, cp_impl="ring")),
    ("tiny", dict(cp=2, tp=2, cp_impl="allgather")),
    ("tiny-moe", dict(dp=2, cp=2, cp_impl="ring")),
    # a real ring (next ≠ previous rank), and Ulysses with fewer KV heads than cp ranks
    ("tiny", dict(cp=4, cp_impl="ring")),
    ("tiny", dict(cp=4, cp_impl="ulysses")),
]
CASES = Batch(
    [Case(m, lay, WORLD, TRAIN, STEPS, ACCUMULATION, ledger_steps=(LEDGER_STEP,)) for m, lay in LAYOUTS],
    timeout=300,
)
IDS = [c.id.removeprefix(f"w{WORLD}-") for c in CASES.cases]


def expected_cp_traffic(spec: ModelSpec, layout: Layout) -> dict[tuple[str, str], tuple[int, int]]:
    """(axis, op) -> (count, bytes) on axis cp for one step's forward + backward passes."""
    cp, mb, d = layout.cp, TRAIN.micro_batch, spec.head_dim
    seq, local_seq = TRAIN.seq_len, TRAIN.seq_len // cp
    heads = spec.heads // layout.tp
    kv_heads = spec.kv_heads // layout.tp if layout.tp <= spec.kv_heads else spec.kv_heads
    passes = ACCUMULATION * spec.layers
    out: dict[tuple[str, str], tuple[int, int]] = {}
    if layout.cp_impl == "ulysses":
        kv = kv_heads if kv_heads % cp == 0 else heads
        q_bytes, kv_bytes = mb * heads * local_seq * d * F32, mb * kv * local_seq * d * F32
        # forward: q, k, v there and the output back; backward: the same four the other way
        out[("cp", "all_to_all")] = (8 * passes, passes * 2 * (2 * q_bytes + 2 * kv_bytes))
    elif layout.cp_impl == "ring":
        # forward: K and V (one buffer) hop cp-1 times; backward: they hop cp-1 times again and
        # the buffer of their gradients cp times (the last hop brings it to the block's owner)
        block = 2 * mb * kv_heads * local_seq * d * F32
        hops = passes * (3 * cp - 2)
        out[("cp", "send")] = out[("cp", "recv")] = (hops, hops * block)
    else:
        gathered = mb * kv_heads * seq * d * F32  # one of K, V for the whole sequence
        out[("cp", "all_gather")] = (2 * passes, 2 * passes * gathered)
        out[("cp", "reduce_scatter")] = (2 * passes, 2 * passes * gathered)
    if layout.dp * layout.fsdp == 1:
        # the cp group is then also the replica group: DDP (or `replicate` under tp) all-reduces
        # the gradients (and the loss) over it, as it would over dp = cp
        as_dp = Layout(dp=cp, tp=layout.tp).resolve(cp * layout.tp)
        theory = expected_forward_backward(spec, as_dp, mb, seq, ACCUMULATION)
        out[("cp", "all_reduce")] = theory[("dp", "all_reduce")]
    moe = sum(spec.is_moe_layer(i) for i in range(spec.layers))
    if moe and spec.aux_loss_coef > 0:  # counts and probability sums per sequence and expert
        stats = mb * 2 * spec.experts * F32
        out[("cp", "all_reduce")] = (2 * ACCUMULATION * moe, 2 * ACCUMULATION * moe * stats)
    return out


def test_load_balanced_split_reassembles_the_sequence() -> None:
    from fivefold.parallel.context import gathered_positions, split_sequence

    tokens = torch.arange(3 * 24).view(3, 24) * 7
    for cp in (1, 2, 3, 4):
        shards = [split_sequence(tokens, cp, r) for r in range(cp)]
        chunk = 24 // (2 * cp)
        for r, (part, pos) in enumerate(shards):
            # chunks r and 2cp-1-r: an early and a late one, so causal work is balanced
            want = list(range(r * chunk, (r + 1) * chunk)) + list(
                range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)
            )
            assert pos[0].tolist() == want and (pos == pos[0]).all()
            assert torch.equal(part, tokens[:, want])
        # every position exactly once; scattering the shards back by position gives the sequence
        positions = torch.cat([pos[0] for _, pos in shards])
        assert sorted(positions.tolist()) == list(range(24))
        assert torch.equal(positions, gathered_positions(24, cp))
        whole = torch.empty_like(tokens)
        whole[:, positions] = torch.cat([part for part, _ in shards], dim=1)
        assert torch.equal(whole, tokens)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES.cases, ids=IDS)
def test_matches_single_process(case: Case) -> None:
    assert_matches(case, CASES.ranks(case), TOLERANCE, clipping=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES.cases, ids=IDS)
def test_ledger_shows_the_cp_traffic(case: Case) -> None:
    layout, _, _ = case.resolve()
    expected = expected_cp_traffic(case.spec(), layout)
    for rank, r in enumerate(CASES.ranks(case)):
        [(fwd_bwd, _)] = r["ledger"]
        # (DDP's broadcast of the model's buffers before each forward is not cp traffic)
        got = {
            (row["axis"], row["op"]): (row["count"], row["bytes"])
            for row in fwd_bwd
            if row["axis"] == "cp" and row["op"] != "broadcast"
        }
        assert got == expected, f"rank {rank}"


@pytest.mark.parametrize("key_offset", [0, 6])  # 6: the first three queries see no key of the block
def test_a_ring_block_through_the_fused_cpu_kernel_equals_the_explicit_softmax(
    monkeypatch, key_offset
) -> None:
    """The ring core runs each K/V block through torch's fused CPU kernel where it can and writes the
    softmax out elsewhere (GPUs): both give the same block output, log-sum-exp and gradients from the
    merged output, also where a query sees none of the block's keys (its log-sum-exp ~ -huge, so
    the merge gives the block no weight)."""
    from fivefold.parallel import context

    if context._CPU_FLASH is None:
        pytest.skip("this torch has no fused CPU attention kernel")
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 8, 4
    q, k, v, grad, out_all = (torch.randn(b, h, s, d) for _ in range(5))
    q_pos, k_pos = torch.arange(s) + 3, torch.arange(s) + key_offset
    lse_all = torch.randn(b, h, s, 1).abs() + 2.0  # a merged log-sum-exp: finite for every query
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(context, "_fused", lambda _q, fused=fused: fused)
        out, lse = context._block_forward(q, k, v, q_pos, k_pos, d**-0.5)
        grads = context._block_backward(grad, q, k, v, out_all, lse_all, q_pos, k_pos, d**-0.5)
        results[fused] = (out, lse, *grads)
    sees = (q_pos[:, None] >= k_pos[None, :]).any(dim=1)
    assert sees.any() and (sees.all() == (key_offset == 0))
    (out_f, lse_f, *grads_f), (out_p, lse_p, *grads_p) = results[True], results[False]
    assert torch.allclose(out_f[:, :, sees], out_p[:, :, sees], atol=1e-5)
    assert torch.allclose(lse_f[:, :, sees], lse_p[:, :, sees], atol=1e-5)
    assert (lse_f[:, :, ~sees] < -1e20).all() and (lse_p[:, :, ~sees] < -1e20).all()
    for fused_grad, plain_grad in zip(grads_f, grads_p):
        assert torch.allclose(fused_grad, plain_grad, atol=1e-5)
