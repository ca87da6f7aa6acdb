"""A Hugging Face `config.json` (Llama, Mistral, Mixtral, Qwen, DeepSeek) as a `ModelSpec`."""

from __future__ import annotations

from typing import Any

from fivefold.config.files import _from_dict
from fivefold.config.model import ModelSpec
from fivefold.errors import FivefoldError


class NotBuilt(FivefoldError):
    """A well-formed config of a network the runtime does not build (its architecture, activation or
    rotary scaling): the planner may still read it by its shape (`model_spec_from_hf_shape`)."""


_HF_ARCH = (
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "DeepseekV3ForCausalLM",
)


def model_spec_from_hf(cfg: dict[str, Any], name: str = "hf") -> ModelSpec:
    """Translate an HF `config.json` dict (Llama, Mistral, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3)."""
    return _read(_model_spec_from_hf, cfg, name)


def _read(reader: Any, cfg: Any, name: str, needs: str = "") -> ModelSpec:
    """`reader(cfg, name)`, with a malformed config named in one line (`needs`: what the key is for)."""
    if not isinstance(cfg, dict):
        raise FivefoldError(f"HF config {name}: expected a JSON object, got {type(cfg).__name__}")
    try:
        return reader(cfg, name)
    except KeyError as exc:
        raise FivefoldError(f"HF config {name}: missing key {exc}{needs}") from None
    # wrong types, zeros, a number too large for a float
    except (TypeError, ValueError, ZeroDivisionError, AttributeError, OverflowError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise FivefoldError(
            f"HF config {name}: a value has the wrong type or is zero ({reason}); sizes and counts "
            "must be positive integers"
        ) from None


def _model_spec_from_hf(cfg: dict[str, Any], name: str) -> ModelSpec:
    archs = cfg.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs  # a bare name, where a list belongs
    model_type = cfg.get("model_type", "")
    if archs and not any(a in _HF_ARCH for a in archs):
        raise NotBuilt(f"unsupported HF architecture {archs}; supported: {', '.join(_HF_ARCH)}")
    try:
        heads = cfg["num_attention_heads"]
        spec: dict[str, Any] = dict(
            name=name,
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            vocab=cfg["vocab_size"],
            ffn_hidden=cfg.get("intermediate_size", 0),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            rope_theta=float(
                cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4))
            ),
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            tie_embeddings=cfg.get("tie_word_embeddings") or False,  # "false" is parsed, not truthy
            attention_bias=cfg.get("attention_bias") or False,
        )
    except KeyError as exc:
        raise FivefoldError(f"HF config {name}: missing key {exc}") from None
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rs, dict):
        raise FivefoldError(
            f"HF config {name}: rope_scaling must be a JSON object (its rope_type and factors) or null, "
            f"got {rs!r:.60}"
        )
    rtype = rs.get("rope_type", rs.get("type", "default"))
    if rtype == "llama3":
        spec.update(
            rope_scaling="llama3",
            rope_factor=rs["factor"],
            rope_low_freq_factor=rs["low_freq_factor"],
            rope_high_freq_factor=rs["high_freq_factor"],
            rope_original_max_len=rs["original_max_position_embeddings"],
        )
    elif rtype not in ("default", None) and model_type != "deepseek_v3":
        raise NotBuilt(f"HF config {name}: rope scaling {rtype!r} is not supported (default or llama3)")
    if model_type.startswith("qwen3"):
        spec["qk_norm"] = True
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise NotBuilt(f"HF config {name}: only bias-free SwiGLU MLPs (hidden_act silu) are supported")
    try:
        if model_type == "qwen3_moe":  # checked first: transformers 5 also writes num_local_experts here
            spec.update(_qwen3_moe_spec(cfg, name))
        elif "num_local_experts" in cfg:  # Mixtral
            spec.update(
                experts=cfg["num_local_experts"],
                experts_per_token=cfg["num_experts_per_tok"],
                expert_ffn_hidden=cfg["intermediate_size"],
                router_norm_topk=True,
                aux_loss_coef=cfg.get("router_aux_loss_coef", 0.02),
            )
    except KeyError as exc:
        raise FivefoldError(f"HF config {name}: missing key {exc}") from None
    if model_type == "deepseek_v3":
        spec.update(
            experts=cfg["n_routed_experts"],
            experts_per_token=cfg["num_experts_per_tok"],
            expert_ffn_hidden=cfg["moe_intermediate_size"],
            shared_experts=cfg.get("n_shared_experts", 0),
            moe_layers=cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0),
            router_score="sigmoid",
            router_bias_rate=0.001,
            aux_loss_coef=0.0,
            **_latent_attention(cfg),
        )
    return _from_dict(ModelSpec, spec, f"HF config {name}")


def _latent_attention(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention's sizes (DeepSeek-V2 and V3), as ModelSpec names them."""
    return dict(
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        head_dim=cfg["qk_nope_head_dim"],
    )


def _qwen3_moe_spec(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """Qwen3-MoE: sparse layers, except a leading run of dense ones (`mlp_only_layers`)."""
    layers = cfg["num_hidden_layers"]
    dense = sorted(cfg.get("mlp_only_layers") or [])
    if cfg.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
        raise NotBuilt(
            f"HF config {name}: only Qwen3-MoE whose dense layers come first (mlp_only_layers = 0..k-1, "
            "decoder_sparse_step = 1) is supported"
        )
    return dict(
        experts=cfg.get("num_experts") or cfg["num_local_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        expert_ffn_hidden=cfg["moe_intermediate_size"],
        moe_layers=layers - len(dense),
        router_norm_topk=cfg.get("norm_topk_prob") or False,  # HF's default
        aux_loss_coef=cfg.get("router_aux_loss_coef", 0.001),
    )


# HF model types whose MLP is two matrices around a GELU (the rest gate it: SwiGLU, GeGLU)
GELU_MLP_TYPES = {
    "gpt2",
    "gpt_neox",
    "gptj",
    "gpt_neo",
    "falcon",
    "opt",
    "bloom",
    "gpt_bigcode",
    "phi",
    "starcoder2",
    "mpt",
    "codegen",
    "persimmon",
    "stablelm_epoch",
}
# ... and whose config leaves tie_word_embeddings at transformers' default, True
TIED_BY_DEFAULT = {
    "gpt2",
    "gpt_neo",
    "gptj",
    "falcon",
    "bloom",
    "opt",
    "gpt_bigcode",
    "gemma",
    "gemma2",
    "gemma3_text",
    "codegen",
    "mpt",
}


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` the config sets (architectures spell the same size differently)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is None:
        raise KeyError(" or ".join(keys))
    return default


def model_spec_from_hf_shape(cfg: dict[str, Any], name: str = "hf") -> ModelSpec:
    """Any decoder-only HF `config.json` by its shape alone (layers, widths, heads, experts, MLA), for
    the planner: what the runtime would need to build it exactly (norms, biases, rotary variants) is
    not read. Sizes spelt the GPT-2, NeoX, Falcon or DeepSeek way are read too."""
    return _read(_shape_spec, cfg, name, " (the planner needs the model's sizes)")


def _shape_spec(cfg: dict[str, Any], name: str) -> ModelSpec:
    model_type = str(cfg.get("model_type", "")).lower()
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in cfg:  # a multimodal wrapper: its decoder
        cfg, model_type = text, str(text.get("model_type", model_type)).lower()
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads")
    if cfg.get("multi_query") and not cfg.get("new_decoder_architecture"):
        kv_heads = 1  # Falcon-7B's and StarCoder's multi-query attention
    else:
        kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads)
    gelu = model_type in GELU_MLP_TYPES
    spec: dict[str, Any] = dict(
        name=name,
        layers=_first(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=_first(cfg, "vocab_size", "padded_vocab_size"),
        ffn_hidden=_first(
            cfg, "intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim", "d_ff", default=4 * hidden
        ),
        head_dim=_first(cfg, "head_dim", "kv_channels", default=hidden // heads),
        max_seq_len=_first(
            cfg,
            "max_position_embeddings",
            "n_positions",
            "seq_length",
            "max_sequence_length",
            "n_ctx",
            default=4096,
        ),
        tie_embeddings=cfg.get("tie_word_embeddings", model_type in TIED_BY_DEFAULT),
        mlp="gelu" if gelu else "swiglu",
    )
    experts = _first(
        cfg, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", default=0
    )
    if experts:
        expert_ffn = _first(
            cfg, "moe_intermediate_size", "expert_intermediate_size", default=spec["ffn_hidden"]
        )
        shared = _first(cfg, "n_shared_experts", "num_shared_experts", default=0)
        if not shared and cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one wide shared expert
            shared = max(1, round(cfg["shared_expert_intermediate_size"] / expert_ffn))
        dense_first = _first(cfg, "first_k_dense_replace", default=0) or len(cfg.get("mlp_only_layers") or [])
        spec.update(
            experts=experts,
            experts_per_token=_first(cfg, "num_experts_per_tok", "moe_topk", "top_k"),
            expert_ffn_hidden=expert_ffn,
            shared_experts=shared,
            moe_layers=spec["layers"] - dense_first,
        )
    if cfg.get("kv_lora_rank"):
        spec.update(_latent_attention(cfg))
    return _from_dict(ModelSpec, spec, f"HF config {name}")
