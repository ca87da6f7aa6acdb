"""Context parallelism: each of the `cp` ranks holds a slice of every sequence.

The split is load-balanced for causal attention: the sequence is cut into 2·cp chunks and rank i
takes chunks i and 2·cp−1−i, so every rank has as many early (cheap) as late (expensive) queries.
Rotary tables come from the real positions (`position_ids`), and every attention core knows the
positions of its queries and of the keys it receives, so the causal mask is that of the whole
sequence. Everything outside attention is per token and needs no communication. Each rank's loss
is the mean over its tokens; ranks hold equal token counts, so the runner's average over `cp`
is the global mean.

Three attention cores (`--cp-impl`), each a drop-in for `Attention.core`:

* `allgather`: K and V gathered over `cp` (autograd-aware: backward reduce-scatters their
  gradients), then one SDPA call with the mask built from the real positions.
* `ring`: K/V blocks passed around the ring with send/recv, one hop per step, each block's
  partial softmax merged into the running output by the log-sum-exp trick; the backward is
  written by hand (`_RingAttention`): the blocks go round again with a dK/dV buffer that
  collects every rank's share and takes one last hop home. The next block is received before
  the current one is used, but nothing overlaps transfer with compute on purpose yet.
* `ulysses`: an all-to-all turns [sequence shard, all heads] into [whole sequence, heads/cp],
  plain causal SDPA runs on the sequence restored to position order, and a second all-to-all
  turns the output back.

MoE layers' sequence-wise auxiliary loss needs statistics of the whole sequence: under cp the
per-expert counts and probability sums are all-reduced over `cp` before the loss is formed.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from fivefold.errors import FivefoldError
from fivefold.model import cpu_attention
from fivefold.model.moe import MoE
from fivefold.torch_internals import cpu_flash_attention_ops

# torch's fused CPU attention kernel, which also returns the log-sum-exp a ring merges blocks by
# (SDPA's public call does not); torch's own ring attention dispatches only to the CUDA kernels
_CPU_FLASH = cpu_flash_attention_ops()

# the autograd-aware all-gather (backward: reduce-scatter); torch 2.13 renamed it, keeping the old name
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

# far below any real score, yet finite: a block a query cannot see gets weight exp(-huge) = 0
# without the NaNs a fully -inf row would give in softmax and its gradient
_MASKED = -1e30


def shard_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions rank `rank` of `cp` holds: chunks rank and 2cp−1−rank of 2cp (contiguous if 2cp ∤ seq)."""
    if seq_len % (2 * cp) == 0:
        chunk = seq_len // (2 * cp)
        first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
        return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))
    if seq_len % cp:
        raise FivefoldError(f"sequence length {seq_len} must be divisible by --cp {cp}")
    per = seq_len // cp
    return torch.arange(rank * per, (rank + 1) * per)


def gathered_positions(seq_len: int, cp: int) -> torch.Tensor:
    """Positions of a tensor gathered over cp in rank order (rank 0's shard, then rank 1's, ...)."""
    return torch.cat([shard_positions(seq_len, cp, r) for r in range(cp)])


def split_sequence(tokens: torch.Tensor, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's columns of `tokens` [b, s], their position_ids [b, s/cp])."""
    b, s = tokens.shape[:2]
    pos = shard_positions(s, cp, rank).to(tokens.device)
    return tokens[:, pos], pos.unsqueeze(0).expand(b, -1)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V heads repeated so query head j reads kv head j // (heads / kv_heads), as SDPA's GQA does."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


class ContextParallelCore(nn.Module):
    """Causal attention over a load-balanced sequence shard; q: [b, hq, s/cp, d], k/v: [b, hkv, s/cp, d]."""

    def __init__(self, impl: str, group: dist.ProcessGroup, cp: int) -> None:
        super().__init__()
        self.impl, self.group, self.cp = impl, group, cp
        self.rank = dist.get_rank(group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int = 0) -> torch.Tensor:
        if q_offset:
            raise FivefoldError("context parallelism trains on whole sequences; it has no KV-cache decoding")
        seq_len = q.shape[2] * self.cp
        if self.impl == "ulysses":
            return self._ulysses(q, k, v, seq_len)
        if self.impl == "ring":
            return _RingAttention.apply(q, k, v, self.group, self.cp)
        q_pos = shard_positions(seq_len, self.cp, self.rank).to(q.device)
        k_all = _all_gather(k.contiguous(), gather_dim=2, group=self.group)
        v_all = _all_gather(v.contiguous(), gather_dim=2, group=self.group)
        k_pos = gathered_positions(seq_len, self.cp).to(q.device)
        mask = q_pos[:, None] >= k_pos[None, :]
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=gqa)

    def _ulysses(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int) -> torch.Tensor:
        heads = q.shape[1]
        if heads % self.cp:
            raise FivefoldError(f"--cp-impl ulysses needs local heads ({heads}) divisible by --cp {self.cp}")
        if k.shape[1] % self.cp:  # too few KV heads to split: give every query head its own
            k, v = repeat_kv(k, heads), repeat_kv(v, heads)
        order = gathered_positions(seq_len, self.cp).to(q.device)
        to_positions = torch.argsort(order)
        q, k, v = (self._heads_to_sequence(t)[:, :, to_positions] for t in (q, k, v))
        out = cpu_attention.causal_attention(q, k, v)  # the single process's kernel choice
        return self._sequence_to_heads(out[:, :, order])

    def _heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[b, h, s/cp, d] -> [b, h/cp, s, d], the sequence in gathered (rank) order."""
        b, h, s, d = x.shape
        send = x.view(b, self.cp, h // self.cp, s, d).transpose(0, 1).contiguous()
        got = all_to_all_single_autograd(send, None, None, self.group)  # [cp (source), b, h/cp, s, d]
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // self.cp, self.cp * s, d)

    def _sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[b, h/cp, s, d] (rank order) -> [b, h, s/cp, d]."""
        b, hc, s, d = x.shape
        send = x.view(b, hc, self.cp, s // self.cp, d).permute(2, 0, 1, 3, 4).contiguous()
        got = all_to_all_single_autograd(send, None, None, self.group)  # [cp (head group), b, h/cp, s/cp, d]
        return got.transpose(0, 1).reshape(b, hc * self.cp, s // self.cp, d)


def _pass_on(tensor: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """Send `tensor` to the next rank of the ring and receive the previous rank's."""
    rank = dist.get_rank(group)
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % cp), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % cp), group),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _block_scores(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked, scaled scores of q against one key block (fp32)."""
    scores = (q @ k.transpose(-2, -1)).float() * scale
    return scores.masked_fill(q_pos[:, None] < k_pos[None, :], _MASKED)


def _fused(q: torch.Tensor) -> bool:
    """Whether a block runs through torch's fused CPU kernel (one pass, no s×s tensors kept)."""
    return _CPU_FLASH is not None and q.device.type == "cpu"


def _block_bias(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The causal mask of a query shard against one key block, as an additive fp32 bias."""
    bias = torch.zeros(len(q_pos), len(k_pos), device=q_pos.device)
    return bias.masked_fill_(q_pos[:, None] < k_pos[None, :], _MASKED)


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(QKᵀ·scale)V, log-sum-exp [..., 1]) of q against one K/V block, in fp32. A query that
    sees no key of the block gets a log-sum-exp near _MASKED: its merge weight is exp(-huge) = 0."""
    if _fused(q):
        with torch.autocast("cpu", enabled=False):
            out, lse = _CPU_FLASH[0](  # type: ignore[index]
                q.float(), k.float(), v.float(), 0.0, False, attn_mask=_block_bias(q_pos, k_pos), scale=scale
            )
        return out, lse.unsqueeze(-1)
    scores = _block_scores(q, k, q_pos, k_pos, scale)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v.float(), lse


def _block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (dQ, dK, dV) of one block's share, from the merged output and log-sum-exp of every
    block (fp32 grad_out, q, k, v, out): the softmax over all keys restricted to this block's."""
    if _fused(q):
        with torch.autocast("cpu", enabled=False):
            return _CPU_FLASH[1](  # type: ignore[index]
                grad_out,
                q,
                k,
                v,
                out,
                lse.squeeze(-1),
                0.0,
                False,
                attn_mask=_block_bias(q_pos, k_pos),
                scale=scale,
            )
    probs = torch.exp(_block_scores(q, k, q_pos, k_pos, scale) - lse)
    grad_v = probs.transpose(-2, -1) @ grad_out
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O)
    grad_scores = probs * (grad_out @ v.transpose(-2, -1) - delta)
    return (grad_scores @ k) * scale, (grad_scores.transpose(-2, -1) @ q) * scale, grad_v


class _RingAttention(torch.autograd.Function):
    """Ring attention with a hand-written backward.

    Forward: K/V blocks travel around the ring by send/recv (own block first, then the previous
    rank's, ...); each block's partial softmax is merged into the running output by log-sum-exp.
    Backward: the blocks travel the ring again; each rank adds its queries' share of dK/dV to a
    gradient buffer that travels with the block, and one last hop brings the buffer home. The
    softmax is recomputed per block from the saved log-sum-exp (as flash attention does).
    """

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,  # type: ignore[override]
        group: dist.ProcessGroup,
        cp: int,
    ) -> torch.Tensor:
        rank, heads, scale = dist.get_rank(group), q.shape[1], q.shape[-1] ** -0.5
        seq_len = q.shape[2] * cp
        q_pos = shard_positions(seq_len, cp, rank).to(q.device)
        kv = torch.stack((k, v)).contiguous()
        out = lse = None
        for step in range(cp):
            src = (rank - step) % cp
            nxt = _pass_on(kv, group, cp) if step < cp - 1 else None
            k_pos = shard_positions(seq_len, cp, src).to(q.device)
            k_rep, v_rep = repeat_kv(kv[0], heads), repeat_kv(kv[1], heads)
            block_out, block_lse = _block_forward(q, k_rep, v_rep, q_pos, k_pos, scale)
            if out is None:  # the own block: every query sees at least itself, so lse is finite
                out, lse = block_out, block_lse
            else:
                new_lse = torch.logaddexp(lse, block_lse)
                out = out * torch.exp(lse - new_lse) + block_out * torch.exp(block_lse - new_lse)
                lse = new_lse
            kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.cp = group, cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group, cp = ctx.group, ctx.cp
        rank, heads, scale = dist.get_rank(group), q.shape[1], q.shape[-1] ** -0.5
        seq_len = q.shape[2] * cp
        q_pos = shard_positions(seq_len, cp, rank).to(q.device)
        grad_out = grad_out.float()
        qf = q.float()
        grad_q = torch.zeros_like(qf)
        kv = torch.stack((k, v)).contiguous()
        grad_kv = torch.zeros_like(kv, dtype=torch.float32)  # travels with kv, for the block's owner
        groups = heads // k.shape[1]
        for step in range(cp):
            src = (rank - step) % cp
            k_pos = shard_positions(seq_len, cp, src).to(q.device)
            k_rep, v_rep = repeat_kv(kv[0], heads).float(), repeat_kv(kv[1], heads).float()
            block_q, grad_k, grad_v = _block_backward(
                grad_out, qf, k_rep, v_rep, out, lse, q_pos, k_pos, scale
            )
            grad_q += block_q
            b, _, s, d = grad_k.shape  # sum the query heads that share a kv head
            grad_kv[0] += grad_k.reshape(b, -1, groups, s, d).sum(2)
            grad_kv[1] += grad_v.reshape(b, -1, groups, s, d).sum(2)
            if step < cp - 1:
                kv = _pass_on(kv, group, cp)
            grad_kv = _pass_on(grad_kv, group, cp)  # after cp hops the buffer is back at its owner
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None


def _cp_sequence_aux_loss(
    moe: MoE, group: dist.ProcessGroup, probs: torch.Tensor, chosen: torch.Tensor
) -> torch.Tensor:
    """MoE's sequence-wise auxiliary loss from whole-sequence statistics summed over `cp`."""
    from torch.distributed.nn.functional import all_reduce  # autograd-aware: backward sums too

    b, s, k = chosen.shape
    e = moe.num_experts
    counts = torch.zeros(b, e, device=probs.device).scatter_add_(
        1, chosen.reshape(b, -1), torch.ones(b, s * k, device=probs.device)
    )
    summed = all_reduce(torch.cat((counts, probs.sum(dim=1).to(counts.dtype)), dim=1), group=group)
    full = s * dist.get_world_size(group)
    load = summed[:, :e] * (e / (k * full))
    return (load * summed[:, e:] / full).sum(dim=-1).mean()


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, cp: int, impl: str) -> None:
    """Swap every block's attention core for the cp core; make MoE aux losses whole-sequence."""
    for block in model.model.layers.values():
        block.self_attn.core = ContextParallelCore(impl, group, cp)
    for module in model.modules():
        if isinstance(module, MoE):
            module.sequence_aux_loss = functools.partial(_cp_sequence_aux_loss, module, group)
