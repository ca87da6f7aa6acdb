"""`ModelSpec`: the transformer's shape, validated once."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fivefold.errors import FivefoldError, divisors, suggest

MAX_LAYERS = 10_000  # published models have a few hundred at most
# any width, count or length past this is a typo: the largest published models are 10^4-10^5 wide,
# with vocabularies of 10^5-10^6; a width of 1e300 overflowed the planner's float arithmetic
MAX_DIM = 2**30
NON_NEGATIVE_COUNTS = (
    "experts",
    "experts_per_token",
    "expert_ffn_hidden",
    "shared_experts",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_original_max_len",
)
POSITIVE_REALS = ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "norm_eps")
NON_NEGATIVE_REALS = ("init_std", "aux_loss_coef", "router_bias_rate")
# where a value past these is no model but a slip: weights drawn at std 1e300, a norm whose epsilon
# drowns every activation, rotary angles that grow with position instead of shrinking (theta <= 1)
PLAUSIBLE_REALS = {"init_std": (0.0, 1.0), "norm_eps": (0.0, 0.1), "rope_theta": (1.0, 1e12)}
MLPS = ("swiglu", "gelu")


def check_buildable(spec: ModelSpec) -> None:
    """Refuse a model the runtime cannot build exactly (it plans, but `train`, `verify` and `generate`
    would run a different network): an MLP other than SwiGLU, or multi-head latent attention."""
    if spec.mlp != "swiglu":
        raise FivefoldError(
            f"model {spec.name} has a two-matrix {spec.mlp.upper()} MLP: fivefold plans it (plan, explore) "
            'but builds SwiGLU blocks only; train a model with mlp = "swiglu"'
        )
    if spec.is_mla:  # the blocks would be grouped-query attention, ignoring the latent sizes
        raise FivefoldError(
            f"model {spec.name} has multi-head latent attention (kv_lora_rank {spec.kv_lora_rank}): fivefold "
            "plans it (plan, explore) but builds grouped-query attention only; train a model with "
            "kv_lora_rank = 0"
        )


@dataclass
class ModelSpec:
    """A decoder-only transformer (Llama-3 style), optionally with mixture-of-experts MLPs.

    Field names follow the planner's TOML contract (`layers, hidden, ffn_hidden, heads, kv_heads,
    vocab`, + MoE keys). `head_dim = 0` means hidden // heads.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn_hidden: int = 0
    kv_heads: int = 0  # 0 means = heads (plain multi-head attention)
    head_dim: int = 0
    name: str = "custom"
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | llama3
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k
    # the MLP: swiglu (gate, up and down matrices; what fivefold builds) or gelu (up and down, GPT-2's,
    # GPT-NeoX's, Falcon's), which the planner plans and the runtime refuses (`check_buildable`)
    mlp: str = "swiglu"
    attention_bias: bool = False
    init_std: float = 0.02
    # mixture of experts (experts = 0: dense)
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn_hidden: int = 0
    shared_experts: int = 0
    moe_layers: int = -1  # how many layers are MoE (the last ones); -1: all when experts > 0
    router_score: str = "softmax"  # softmax | sigmoid
    router_norm_topk: bool = True  # renormalise the top-k weights to sum to 1
    aux_loss_coef: float = 0.01  # load-balancing loss weight (0 disables)
    router_bias_rate: float = 0.0  # auxiliary-loss-free balancing: bias update speed (0 disables)
    # multi-head latent attention dims (DeepSeek-V3); planning only, 0 = not MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.kv_heads == 0:
            self.kv_heads = self.heads
        if self.head_dim == 0 and self.heads > 0:
            if self.hidden % self.heads:  # a rounded-down head_dim would build another model than asked
                raise FivefoldError(
                    f"model {self.name}: hidden ({self.hidden}) is not a multiple of heads ({self.heads}), "
                    f"so head_dim = hidden / heads is not whole; valid heads: "
                    f"{suggest(divisors(self.hidden)) if self.hidden > 0 else 'any, with hidden > 0'}, "
                    "or set head_dim"
                )
            self.head_dim = self.hidden // self.heads
        if self.ffn_hidden == 0:
            self.ffn_hidden = self.expert_ffn_hidden if self.experts else 4 * self.hidden
        if self.experts and self.moe_layers < 0:
            self.moe_layers = self.layers
        if not self.experts:
            self.moe_layers = 0

    # ---- validation
    def validate(self) -> ModelSpec:
        if not str(self.name).isprintable():  # it heads every table, and names the default run directory
            raise FivefoldError(f"model name {self.name!r} holds control characters; give a plain name")
        if self.max_seq_len <= 0:
            raise FivefoldError(f"model {self.name}: max_seq_len must be positive, got {self.max_seq_len}")
        for name in NON_NEGATIVE_COUNTS:  # a negative count would slip past the `if experts:` tests below
            if getattr(self, name) < 0:
                raise FivefoldError(f"model {self.name}: {name} must be 0 or more, got {getattr(self, name)}")
        # a NaN or negative here trains or samples NaN from the first step on
        for name in POSITIVE_REALS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise FivefoldError(
                    f"model {self.name}: {name} must be a positive finite number, got {value}"
                )
        for name in NON_NEGATIVE_REALS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise FivefoldError(f"model {self.name}: {name} must be a finite number >= 0, got {value}")
        for name, (low, high) in PLAUSIBLE_REALS.items():
            value = getattr(self, name)
            if not low <= value <= high or (name == "rope_theta" and value == low):
                above = "above" if name == "rope_theta" else "at least"
                raise FivefoldError(
                    f"model {self.name}: {name} must be {above} {low:g} and at most {high:g}, got {value:g}"
                )
        for name in ("layers", "hidden", "heads", "vocab", "ffn_hidden", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise FivefoldError(f"model {self.name}: {name} must be positive, got {getattr(self, name)}")
        for name in (f.name for f in dataclasses.fields(self)):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_DIM:
                raise FivefoldError(f"model {self.name}: {name} must be at most {MAX_DIM:,}, got {value:.3g}")
        if self.layers > MAX_LAYERS:  # the planner and the runtime walk the layers one by one
            raise FivefoldError(
                f"model {self.name}: layers must be at most {MAX_LAYERS:,}, got {self.layers:,}"
            )
        if self.heads % self.kv_heads:
            raise FivefoldError(
                f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads "
                f"({self.kv_heads}); valid kv_heads: {suggest(divisors(self.heads))}"
            )
        if self.head_dim % 2:
            raise FivefoldError(f"model {self.name}: head_dim ({self.head_dim}) must be even for RoPE")
        if self.rope_scaling not in ("none", "llama3"):
            raise FivefoldError(f"model {self.name}: rope_scaling must be none or llama3")
        if self.mlp not in MLPS:
            raise FivefoldError(f"model {self.name}: mlp must be one of {', '.join(MLPS)}, got {self.mlp!r}")
        if self.experts:
            if not 0 < self.experts_per_token <= self.experts:
                raise FivefoldError(
                    f"model {self.name}: experts_per_token must be in 1..{self.experts}, "
                    f"got {self.experts_per_token}"
                )
            if self.expert_ffn_hidden <= 0:
                raise FivefoldError(f"model {self.name}: expert_ffn_hidden must be positive for MoE")
            if not 0 <= self.moe_layers <= self.layers:
                raise FivefoldError(f"model {self.name}: moe_layers must be in 0..{self.layers}")
            if self.router_score not in ("softmax", "sigmoid"):
                raise FivefoldError(f"model {self.name}: router_score must be softmax or sigmoid")
        # latent attention's sizes come together: its values' width is the output projection's input,
        # and without kv_lora_rank the other two would be read as nothing, without a word
        latent = {k: getattr(self, k) for k in ("qk_rope_head_dim", "v_head_dim") if getattr(self, k)}
        if self.is_mla and self.v_head_dim <= 0:
            raise FivefoldError(
                f"model {self.name}: kv_lora_rank {self.kv_lora_rank} (latent attention) needs v_head_dim, "
                "the width of each head's values (DeepSeek-V2/V3: 128)"
            )
        if latent and not self.is_mla:
            given = ", ".join(latent)
            raise FivefoldError(
                f"model {self.name}: {given} size latent attention, which kv_lora_rank turns on; give "
                f"kv_lora_rank (DeepSeek-V3: 512), or leave {given} out"
            )
        return self

    # ---- derived
    @property
    def is_moe(self) -> bool:
        return self.experts > 0 and self.moe_layers > 0

    @property
    def first_moe_layer(self) -> int:
        return self.layers - self.moe_layers

    def is_moe_layer(self, index: int) -> bool:
        return self.is_moe and index >= self.first_moe_layer

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_params(self) -> int:
        h, d = self.hidden, self.head_dim
        if self.is_mla:
            qk_head = d + self.qk_rope_head_dim
            q = (
                (h * self.q_lora_rank + self.q_lora_rank * self.heads * qk_head)
                if self.q_lora_rank
                else (h * self.heads * qk_head)
            )
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * self.heads * (
                d + self.v_head_dim
            )
            return q + kv + self.heads * self.v_head_dim * h
        qkv = h * d * (self.heads + 2 * self.kv_heads)
        bias = d * (self.heads + 2 * self.kv_heads) if self.attention_bias else 0
        norms = 2 * d if self.qk_norm else 0
        return qkv + bias + self.heads * d * h + norms

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.ffn_hidden

    def expert_params(self) -> int:
        """One routed expert's SwiGLU weights."""
        return 3 * self.hidden * self.expert_ffn_hidden

    def moe_layer_params(self, active: bool = False) -> int:
        routed = self.experts_per_token if active else self.experts
        shared = self.shared_experts * self.expert_params()
        return routed * self.expert_params() + shared + self.hidden * self.experts  # + router

    def layer_params(self, index: int, active: bool = False) -> int:
        mlp = self.moe_layer_params(active) if self.is_moe_layer(index) else self.dense_mlp_params()
        return self.attention_params() + mlp + 2 * self.hidden

    def num_params(self, active: bool = False, embeddings: bool = True) -> int:
        """Parameter count; `active` counts only the experts a token is routed to."""
        body = sum(self.layer_params(i, active) for i in range(self.layers)) + self.hidden  # final norm
        emb = self.vocab * self.hidden
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return body + ((emb + head) if embeddings else head)


def check_seq_len(model: ModelSpec, seq_len: int, flag: str = "--seq-len", shortest: int = 1) -> None:
    """A run's sequences fit the model's positions (RoPE tables and HF configs are sized for them);
    a serving context (`--context`) holds at least a prompt token and a generated one."""
    if seq_len < shortest:
        what = " (a prompt token and a generated one)" if shortest > 1 else ""
        raise FivefoldError(f"{flag} {seq_len} is too short{what}; valid: {shortest}..{model.max_seq_len}")
    if seq_len > model.max_seq_len:
        raise FivefoldError(
            f"{flag} {seq_len} exceeds the {model.max_seq_len} positions of model {model.name} "
            f"(max_seq_len); valid: {shortest}..{model.max_seq_len}"
        )
