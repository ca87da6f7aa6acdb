"""Context parallelism for generation: each of the `cp` ranks caches a share of every sequence's keys.

* **Prefill.** The left-padded prompt batch is widened on the left with masked columns to a multiple
  of 2·cp and split as training splits a sequence (`context.shard_positions`: rank i takes chunks i
  and 2cp−1−i of 2cp). Each rank embeds and runs only its columns; in attention it gathers the
  layer's K and V over cp (as the training `allgather` core does, here with the padding mask) and
  keeps only its own columns in its cache. The last column lies in chunk 2cp−1, on cp rank 0.
* **Decode.** The new token's hidden states are the same on every cp rank, so each runs the whole
  layer stack for it; in attention each rank scores the query against its cached keys only, and the
  partial outputs with their log-sum-exp are all-gathered over cp and merged (a softmax over the
  union of the shards is the log-sum-exp weighted mean of the shards' softmaxes): one all-gather of
  b·heads·(head_dim + 1) floats per layer. One rank keeps the new token's K and V, in turn (decode
  step mod cp), so the shards stay within a column of each other.

Cp rank 0 picks every token (only it holds the prompt's last column) and broadcasts it over cp, so the
sampler's generators advance on one rank and the text does not depend on cp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from fivefold.layout_math import cp_prefill_width
from fivefold.model.attention import KVCache
from fivefold.parallel.context import gathered_positions, repeat_kv, shard_positions

_MASKED = -1e30  # a key the query may not see: weight exp(-huge) = 0, and no NaN where a shard has none


@dataclass
class ShardStep:
    """The step under way, as this rank's caches and cores need it (one object shared by its layers)."""

    columns: torch.Tensor  # columns of the widened sequence this rank's queries sit in
    sharded: bool = True  # prefill: the queries are this rank's share; decode: one column, everywhere
    keep: bool = True  # whether this rank caches the keys of this step's columns
    key_mask: torch.Tensor | None = None  # [b, columns so far] (True: a real token), None: none padded
    width: int = 0  # columns of the prefill (a multiple of 2·cp)


class ShardedKVCache(KVCache):
    """A layer's cache of this rank's columns only, with the column each key sits in."""

    def __init__(self, step: ShardStep) -> None:
        super().__init__()
        self.step = step
        self.columns = torch.empty(0, dtype=torch.long)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.step.keep:
            super().append(k, v)
            self.columns = torch.cat((self.columns, self.step.columns.cpu()))
        assert self.k is not None and self.v is not None, "a cp rank holds prefill columns"
        return self.k, self.v


class ShardedDecodeCore(nn.Module):
    """Drop-in for `Attention.core` over a `ShardedKVCache` (q: [b, hq, s, d]; k, v: the rank's cache)."""

    def __init__(self, cache: ShardedKVCache, group: dist.ProcessGroup, cp: int) -> None:
        super().__init__()
        self.cache, self.group, self.cp = cache, group, cp

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_offset: int = 0,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        step = self.cache.step
        if step.sharded:
            return self._prefill(q, k, v, step)
        return self._decode(q, k, v, step)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: ShardStep) -> torch.Tensor:
        k_all = funcol.all_gather_tensor(k.contiguous(), gather_dim=2, group=self.group)
        v_all = funcol.all_gather_tensor(v.contiguous(), gather_dim=2, group=self.group)
        q_cols = step.columns.to(q.device)
        k_cols = gathered_positions(step.width, self.cp).to(q.device)
        mask = (q_cols[:, None] >= k_cols[None, :])[None, None]  # causal over the widened sequence
        if step.key_mask is not None:
            # a padding query sees itself only, so no row is all-masked (as the single process does)
            own = q_cols[:, None] == k_cols[None, :]
            mask = (mask & step.key_mask.to(q.device)[:, k_cols][:, None, None, :]) | own
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=gqa)

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: ShardStep) -> torch.Tensor:
        k, v = repeat_kv(k, q.shape[1]).float(), repeat_kv(v, q.shape[1]).float()
        scores = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [b, hq, s, t_local]
        if step.key_mask is not None:
            seen = step.key_mask.to(q.device)[:, self.cache.columns.to(q.device)]
            scores = scores.masked_fill(~seen[:, None, None, :], _MASKED)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        part = torch.cat((torch.softmax(scores, dim=-1) @ v, lse), dim=-1)  # [b, hq, s, d + 1]
        parts = funcol.all_gather_tensor(part.unsqueeze(0), gather_dim=0, group=self.group)
        out, lses = parts[..., :-1], parts[..., -1:]
        weight = torch.exp(lses - lses.max(dim=0, keepdim=True).values)
        return ((weight * out).sum(dim=0) / weight.sum(dim=0)).to(q.dtype)


class SequenceSplit:
    """The cp side of one rank's decoding: the columns it runs each step, the keys it keeps, and the
    token cp rank 0 picks. Built on a chunk, it gives every attention layer a sharded cache and the
    core that reads it."""

    def __init__(self, chunk: nn.Module, group: dist.ProcessGroup, cp: int, rank: int) -> None:
        self.group, self.cp, self.rank = group, cp, rank
        self.step = ShardStep(columns=torch.empty(0, dtype=torch.long))
        self.caches: list[KVCache] = []
        for block in chunk.model.layers.values():
            cache = ShardedKVCache(self.step)
            block.self_attn.core = ShardedDecodeCore(cache, group, cp)
            self.caches.append(cache)
        self.steps = 0  # steps taken: the first is the prefill
        self.pad = 0  # masked columns put in front of the prompt

    def columns(
        self, inputs: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's share of a step's (inputs, positions) and the key mask over all columns: at the
        prefill its chunks of the widened prompt, after it the new column, on every rank."""
        step = self.step
        if self.steps == 0:
            inputs, positions, key_mask, self.pad = widen(inputs, positions, key_mask, self.cp)
            step.width = inputs.shape[1]
            step.columns = shard_positions(step.width, self.cp, self.rank)
            step.sharded = step.keep = True
            inputs, positions = inputs[:, step.columns], positions[:, step.columns]
        else:
            step.columns = torch.tensor([step.width + self.steps - 1])
            step.sharded = False
            step.keep = (self.steps - 1) % self.cp == self.rank  # the new column's keys, in turn
            if self.pad:  # the masked columns in front, before the decoder's own
                b = inputs.shape[0]
                seen = step.width - self.pad + self.steps  # the decoder's columns, the new one included
                own = key_mask if key_mask is not None else torch.ones(b, seen, dtype=torch.bool)
                key_mask = torch.cat((torch.zeros(b, self.pad, dtype=torch.bool), own), dim=1)
        self.steps += 1
        step.key_mask = key_mask
        return inputs, positions, key_mask

    @property
    def picks(self) -> bool:
        """Whether this rank picks the tokens: cp rank 0 holds the prompt's last column."""
        return self.rank == 0

    def share(self, token: torch.Tensor) -> None:
        """The token cp rank 0 picked, on every cp rank (in place)."""
        dist.broadcast(token, src=dist.get_global_rank(self.group, 0), group=self.group)


def widen(
    inputs: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor | None, cp: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """The prompt batch with masked columns in front, to a width that splits into 2·cp chunks;
    returns (inputs, positions, key mask, columns added)."""
    b, width = inputs.shape
    pad = cp_prefill_width(width, cp) - width
    if pad == 0:
        return inputs, positions, key_mask, 0
    front = torch.zeros(b, pad, dtype=inputs.dtype)
    mask = torch.ones(b, width, dtype=torch.bool) if key_mask is None else key_mask.cpu()
    return (
        torch.cat((front, inputs.cpu()), dim=1),
        torch.cat((front.to(positions.dtype), positions.cpu()), dim=1),
        torch.cat((torch.zeros(b, pad, dtype=torch.bool), mask), dim=1),
        pad,
    )
