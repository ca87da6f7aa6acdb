"""Causal attention of 16-bit tensors on CPU, computed in fp32.

torch's CPU flash-attention kernel is slower in bf16 than in fp32: for 8 sequences of 2,048 tokens
in 16 heads of 16 dimensions (the TorchTitan debug model), forward and backward take 1.16 s in bf16
and 0.74 s with the same kernel in fp32 on a 2-core Xeon with AVX512-BF16 (1 thread: 2.37 s
against 1.32 s).
The kernel spends its time in the exponentials and the per-block bookkeeping, not in the small
matmuls bf16 would speed up, and its bf16 path adds conversions inside every block.

So on CPU a 16-bit q/k/v is cast to fp32 for the kernel and the result cast back. Autograd keeps
what the bf16 kernel keeps (the 16-bit q, k, v and output, the fp32 log-sum-exp), so the memory a
run saves for backward, which `fivefold verify` compares with the plan, does not change; the
backward casts them up again for the fp32 backward kernel. The result is closer to the fp32
reference than the bf16 kernel's (tests/test_model.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fivefold.torch_internals import cpu_flash_attention_ops

_OPS = cpu_flash_attention_ops()


def serves(q: torch.Tensor, k: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype this path runs q/k in, or None where it does not apply: on CPU (eager, or
    under torch.compile, which traces the function), as many kv heads as query heads, and q either
    16-bit or, under a 16-bit autocast, fp32 (rotary's fp32 tables promote it), which SDPA would
    then cast down."""
    if _OPS is None or q.device.type != "cpu" or q.shape[1] != k.shape[1]:
        return None
    if q.dtype in (torch.bfloat16, torch.float16):
        return q.dtype
    if q.dtype == torch.float32 and torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        return dtype if dtype in (torch.bfloat16, torch.float16) else None
    return None


class _CausalAttentionInFp32(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        forward_op, _ = _OPS  # type: ignore[misc]
        with torch.autocast("cpu", enabled=False):
            out32, logsumexp = forward_op(q.float(), k.float(), v.float(), 0.0, True)
        out = out32.to(q.dtype)  # keeps the kernel's [b, s, heads, d] memory layout
        ctx.save_for_backward(q, k, v, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        _, backward_op = _OPS  # type: ignore[misc]
        q, k, v, out, logsumexp = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            gq, gk, gv = backward_op(
                grad_out.float(), q.float(), k.float(), v.float(), out.float(), logsumexp, 0.0, True
            )
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


def causal_attention_in_fp32(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """softmax(QK^T/sqrt(d))V with a causal mask, q/k/v [b, heads, s, d], rounded to `dtype` first
    (as autocast would) and returned in it."""
    return _CausalAttentionInFp32.apply(q.to(dtype), k.to(dtype), v.to(dtype))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of q [b, hq, s, d] over k/v [b, hkv, s, d]; through the fp32 kernel where
    `serves` says so, torch's own choice otherwise."""
    low = serves(q, k)
    if low is not None:
        return causal_attention_in_fp32(q, k, v, low)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
