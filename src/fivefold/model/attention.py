"""Grouped-query attention with rotary position embeddings (Llama 3 / Qwen3 conventions).

Head counts are read from tensor shapes at run time (`view(b, s, -1, head_dim)`), never from the
spec, so tensor parallelism can shard the projections from outside without touching this code.
The score/softmax/value step lives in its own module (`core`) so context parallelism can swap in
a ring or all-to-all implementation from outside.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelSpec
from fivefold.model import cpu_attention


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as HF Llama does), scaled by a learned weight."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same arithmetic in one fused forward kernel (bitwise equal, forward and backward);
            # in lower precision the steps below keep HF's order of roundings
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_inverse_frequencies(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies per rotary pair, with Llama 3's long-context rescaling when asked."""
    dim = spec.head_dim
    # float32 throughout, as the reference implementation computes it
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if spec.rope_scaling != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = spec.rope_original_max_len / spec.rope_low_freq_factor
    high_wavelen = spec.rope_original_max_len / spec.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (spec.rope_original_max_len / wavelen - spec.rope_low_freq_factor) / (
        spec.rope_high_freq_factor - spec.rope_low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / spec.rope_factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.rope_factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_medium, blended, scaled)


class Rope(NamedTuple):
    """Rotary tables for a batch's positions: e^(i·angle) per rotary pair [b, s, d/2] (complex64),
    and the dtype the rotated q and k come out in (that of the residual stream, as a real table of
    its dtype would promote them to)."""

    cis: torch.Tensor
    dtype: torch.dtype


class RotaryEmbedding(nn.Module):
    """Rotary tables for given positions; positions may be any order (context parallel shards)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer("inv_freq", rope_inverse_frequencies(spec), persistent=False)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(rope_inverse_frequencies(self.spec).to(self.inv_freq.device))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Rope:
        """position_ids: [b, s] -> the rotations of every pair at those positions."""
        angles = position_ids[..., None].float() * self.inv_freq.float()
        return Rope(torch.polar(torch.ones_like(angles), angles), dtype)


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x: [b, s, heads, d], as the projection wrote it. The pairs a rotation turns are adjacent,
    (0, 1), (2, 3), ... (Meta's Llama layout; fivefold.model.hf permutes HF's rotate-half q and k
    rows into it on import and back on export): one complex multiply, where rotating pairs half a
    head apart costs a copy of the swapped halves and four more elementwise passes, forward and
    backward (on CPU ~5 ms against ~29 ms for a [8, 2048, 16, 16] tensor). The attention scores
    are unchanged, q and k being permuted alike."""
    dtype = torch.promote_types(x.dtype, rope.dtype)
    if torch.compiler.is_compiling():
        # inductor fuses the real form into one kernel, where it would run a complex multiply as
        # separate ones (a compiled 1.2B step on an H200: 1.7% faster this way)
        table = torch.view_as_real(rope.cis)[:, :, None]
        cos, sin = table[..., 0], table[..., 1]
        pairs = x.float().view(*x.shape[:-1], -1, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2).to(dtype)
    pairs = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rope.cis[:, :, None, :]).flatten(-2).to(dtype)


class AttentionCore(nn.Module):
    """softmax(QK^T / sqrt(d)) V with a causal mask; q: [b, hq, s, d], k/v: [b, hkv, t, d].

    `q_offset` places the queries at the end of the keys (decoding with a KV cache).
    `key_mask` [b, t] (True: a real token) hides padding keys of left-padded batches.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_offset: int = 0,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # query head j reads kv head j // (hq / hkv); SDPA does that without copying K and V
        gqa = q.shape[1] != k.shape[1]
        s, t = q.shape[2], k.shape[2]
        if s == t and key_mask is None:  # on CPU, 16 bits through the faster fp32 kernel (see there)
            return cpu_attention.causal_attention(q, k, v)
        # queries are the last s of t positions: query i sees keys 0..(t - s + i)
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=t - s)
        if key_mask is not None:
            # a padding query sees itself only: its row stays finite (no all-masked softmax), and
            # no real query ever sees a padding key
            own = torch.zeros(s, t, dtype=torch.bool, device=q.device)
            own[torch.arange(s), torch.arange(t - s, t)] = True
            mask = (mask & key_mask[:, None, None, :].to(q.device)) | own
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class KVCache:
    """Per-layer key/value cache for incremental decoding.

    `key_mask` [b, t] (True: a real token), set by the decoder before each step, marks the
    padding of a left-padded batch; None when no row is padded.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.key_mask: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        h, d = spec.hidden, spec.head_dim
        bias = spec.attention_bias
        self.q_proj = nn.Linear(h, spec.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, spec.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, spec.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(spec.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None
        self.core = AttentionCore()

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        offset = 0
        if cache is not None:
            offset = cache.length
            k, v = cache.append(k, v)
        if cache is not None and cache.key_mask is not None:
            out = self.core(q, k, v, q_offset=offset, key_mask=cache.key_mask)
        else:
            out = self.core(q, k, v, q_offset=offset)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
