"""FLOPs per token: the one formula behind every MFU fivefold reports (train metrics and plan).

Model FLOPs (what MFU divides by peak) follow the PaLM / Megatron convention:
  * every weight matmul costs 2 FLOPs per weight per token forward, 4 backward -> 6 · N_matmul,
    where N_matmul counts the parameters a token actually multiplies (routed experts: only the
    top-k ones; the output head: yes; the embedding lookup: no, it is a gather);
  * attention scores and the weighted sum (QK^T and PV) cost 2·2·s·d_attn per layer forward,
    where d_attn = heads · head_dim, times 3 for forward + backward.
`causal=True` counts only the lower triangle (half the attention FLOPs), as FlashAttention
and TorchTitan do; `causal=False` counts the full square, as Megatron's and PaLM's MFU do.
Hardware FLOPs add the recomputed forward: full recompute adds one more forward of every
transformer layer (2·N_matmul without the output head, which sits outside the checkpointed layers,
+ attention forward), or of the share `recomputed` of them when only some blocks are recomputed;
selective recompute adds the attention-core forward only.
`matmul_params` overrides N_matmul for blocks ModelSpec does not describe (the planner's GPT block
with a two-matrix MLP).
"""

from __future__ import annotations

from fivefold.config import ModelSpec


def matmul_params_per_token(model: ModelSpec) -> int:
    """Weights one token multiplies in a forward pass (active experts only, no embedding gather)."""
    body = model.num_params(active=True, embeddings=False)
    head = 0 if not model.tie_embeddings else model.vocab * model.hidden  # tied: the head still multiplies
    return body + head


def attention_flops_per_token(model: ModelSpec, seq_len: int, causal: bool = False) -> float:
    """Forward FLOPs of QK^T and PV per token, summed over layers."""
    qk_dim = model.head_dim + (model.qk_rope_head_dim if model.is_mla else 0)
    v_dim = model.v_head_dim if model.is_mla else model.head_dim
    per_layer = 2 * seq_len * model.heads * (qk_dim + v_dim)
    return model.layers * per_layer * (0.5 if causal else 1.0)


def model_flops_per_token(
    model: ModelSpec, seq_len: int, causal: bool = False, matmul_params: int | None = None
) -> float:
    """Training (forward + backward) model FLOPs per token."""
    n = matmul_params_per_token(model) if matmul_params is None else matmul_params
    return 6.0 * n + 3.0 * attention_flops_per_token(model, seq_len, causal)


def hardware_flops_per_token(
    model: ModelSpec,
    seq_len: int,
    recompute: str = "none",
    causal: bool = False,
    matmul_params: int | None = None,
    recomputed: float = 1.0,
) -> float:
    """Training FLOPs per token actually executed, including recomputation (`recomputed`: the share
    of layers full recompute re-runs)."""
    n = matmul_params_per_token(model) if matmul_params is None else matmul_params
    base = model_flops_per_token(model, seq_len, causal, matmul_params=n)
    attn_fwd = attention_flops_per_token(model, seq_len, causal)
    if recompute == "full":  # the output head is outside the checkpointed layers
        return base + recomputed * (2.0 * (n - model.vocab * model.hidden) + attn_fwd)
    if recompute == "selective":
        return base + attn_fwd
    return base


def inference_flops_per_token(model: ModelSpec, context: int) -> float:
    """Forward FLOPs for one new token attending to `context` previous tokens (decode)."""
    return 2.0 * matmul_params_per_token(model) + attention_flops_per_token(model, context, causal=False)
