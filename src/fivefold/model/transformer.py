"""A decoder-only Llama-3-style transformer, dense or mixture-of-experts, in plain PyTorch.

Parameter names follow HF transformers' Llama (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`,
`model.layers.N.mlp.gate_proj`, `model.norm`, `lm_head`), so checkpoints map one to one.

Built for parallelism applied from outside:
  * layers live in a ModuleDict keyed "0".."L-1": a pipeline stage deletes the layers it does not
    own and the remaining names (and checkpoint keys) stay the same;
  * `embed_tokens`, `norm` and `lm_head` may be None on a stage: the forward then takes hidden
    states in, or gives hidden states out;
  * no head counts are stored, shapes are read at run time (tensor parallelism shards freely).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelSpec, check_buildable
from fivefold.model.attention import Attention, KVCache, RMSNorm, Rope, RotaryEmbedding
from fivefold.model.mlp import SwiGLU
from fivefold.model.moe import MoE


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden, spec.norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.norm_eps)
        self.mlp: nn.Module = MoE(spec) if spec.is_moe_layer(index) else SwiGLU(spec.hidden, spec.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: Rope, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(_matmul_input(self.input_layernorm(x)), rope, cache)
        h = self.post_attention_layernorm(x)
        # an MoE layer takes the norm's output as it is: its router and expert rows are sized by it
        return x + self.mlp(h if isinstance(self.mlp, MoE) else _matmul_input(h))


def _matmul_input(x: torch.Tensor) -> torch.Tensor:
    """A norm's output as the projections after it read it.

    Under autocast every projection casts its input to the compute dtype on its own (autocast
    caches the casts of weights, not of inputs): three passes over the same tensor for q, k and v.
    Casting once here does one, saves one copy for the backward instead of three, and under
    sequence parallelism gathers the sequence in half the bytes. Without autocast: unchanged.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class Decoder(nn.Module):
    """The body (HF's `model.`): embedding, blocks, final norm, rotary tables."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.layers)})
        self.norm: RMSNorm | None = RMSNorm(spec.hidden, spec.norm_eps)
        self.rotary_emb = RotaryEmbedding(spec)


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = Decoder(spec)
        self.lm_head: nn.Linear | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        inputs: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
    ) -> torch.Tensor:
        """inputs: token ids [b, s] (or hidden states [b, s, h] on a later pipeline stage).

        Returns logits [b, s, vocab] (or hidden states where this stage has no head).
        `position_ids` [b, s] default to 0..s-1 (after any cached tokens).
        """
        emb = self.model.embed_tokens
        h = emb(inputs) if emb is not None else inputs
        b, s = h.shape[0], h.shape[1]
        if position_ids is None:
            start = caches[0].length if caches else 0
            position_ids = torch.arange(start, start + s, device=h.device).unsqueeze(0).expand(b, s)
        rope = self.model.rotary_emb(position_ids, h.dtype)
        for i, layer in enumerate(self.model.layers.values()):
            h = layer(h, rope, caches[i] if caches else None)
        if self.model.norm is not None:
            h = self.model.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic initialisation from `seed`, independent of device and of any sharding.

        Each tensor draws from its own generator seeded by (seed, parameter name), so a pipeline
        stage that holds only some layers initialises them exactly as the whole model would.
        Works after `to_empty()` from the meta device.
        """
        std = self.spec.init_std
        # GPT-2/Megatron-style: output projections scaled down by depth to keep the residual stable
        out_std = std / (2 * self.spec.layers) ** 0.5
        for name, param in self.named_parameters():
            gen = torch.Generator().manual_seed(_name_seed(seed, name))
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                values = torch.ones(param.shape)
            elif name.endswith(".bias"):
                values = torch.zeros(param.shape)
            else:
                scale = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else std
                values = torch.randn(param.shape, generator=gen) * scale
            _copy_into(param, values)
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_parameters()
            if isinstance(module, MoE):
                module.gate.expert_bias.zero_()
                module.tokens_per_expert.zero_()


@torch.no_grad()
def init_tied_head(model: Transformer, seed: int = 0) -> None:
    """A pipeline's last chunk holds the output head of a tied model without its embedding: give
    the head the embedding's init, as the whole model's one shared weight has."""
    name = "model.embed_tokens.weight"
    gen = torch.Generator().manual_seed(_name_seed(seed, name))
    _copy_into(
        model.lm_head.weight, torch.randn(model.lm_head.weight.shape, generator=gen) * model.spec.init_std
    )


def _name_seed(seed: int, name: str) -> int:
    # FNV-1a over the name: stable across processes (unlike hash()) and cheap
    h = 0xCBF29CE484222325
    for ch in name.encode():
        h = ((h ^ ch) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return (h ^ (seed * 0x9E3779B97F4A7C15)) & 0x7FFFFFFFFFFFFFFF


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size tensor into a parameter that may be a DTensor shard."""
    local = getattr(param, "_local_tensor", None)
    if local is not None:  # DTensor: take this rank's piece of the full tensor
        from torch.distributed.tensor import distribute_tensor

        # every rank built the same full tensor, so each takes its piece locally (no scatter)
        shard = distribute_tensor(
            full.to(local.device, local.dtype), param.device_mesh, param.placements, src_data_rank=None
        )
        local.copy_(shard.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


def build_model(spec: ModelSpec, device: str | torch.device = "meta") -> Transformer:
    """Construct on `device` (meta by default: no memory until a rank materialises its part)."""
    check_buildable(spec)  # a GELU MLP is planned, never built as a SwiGLU one
    with torch.device(device):
        return Transformer(spec.validate())


def materialize(model: Transformer, device: str | torch.device, seed: int) -> Transformer:
    """Allocate a meta-built model on `device` and initialise it deterministically."""
    model.to_empty(device=device)
    if model.spec.tie_embeddings and model.lm_head is not None and model.model.embed_tokens is not None:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties
    model.init_weights(seed)
    return model


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all label positions, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
