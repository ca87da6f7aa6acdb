"""Configuration: what model, what hardware, which layout, how to train.

Pure Python (no torch import) so that `plan` and `mesh` stay fast. Every spec is a dataclass that
round-trips through TOML; unknown keys and impossible values raise `FivefoldError` naming the
constraint and valid neighbours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from fivefold.errors import FivefoldError, divisors, suggest

AXES = ("dp", "fsdp", "cp", "tp", "pp")  # axes whose product is the world size
ALL_AXES = AXES + ("ep",)
DEFAULT_ORDER = "tp,cp,fsdp,dp,pp"
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
RECOMPUTE = ("none", "selective", "full")
CP_IMPLS = ("ring", "allgather", "ulysses")
DTYPES = ("fp32", "bf16")

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# generic dataclass <-> dict helpers


def _from_dict(cls: type[T], data: dict[str, Any], what: str) -> T:
    """Build a dataclass from a dict, rejecting unknown keys and coercing simple types."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise FivefoldError(
            f"unknown key(s) {', '.join(unknown)} in {what}; valid keys: {suggest(sorted(known), 40)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, known[name], what)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required key is missing
        raise FivefoldError(f"{what}: {exc}") from None


def _coerce(value: Any, f: dataclasses.Field, what: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith(("int", "float")) and isinstance(value, str):
            raise ValueError  # a number written as a string is a mistake, not a number
        if kind.startswith("str") and value is not None and not isinstance(value, str):
            raise FivefoldError(f"{what}: {f.name} must be a string, got {value!r}")
        if kind.startswith("int") and not isinstance(value, bool) and value is not None:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind.startswith("float") and value is not None:
            return float(value)
        if kind.startswith("bool") and isinstance(value, str):
            return value.lower() in ("1", "true", "yes", "on")
    except (TypeError, ValueError):
        raise FivefoldError(f"{what}: {f.name} must be {kind}, got {value!r}") from None
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as a TOML-friendly dict (None values dropped: TOML has no null)."""
    return {k: v for k, v in dataclasses.asdict(obj).items() if v is not None}


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise FivefoldError(f"file not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise FivefoldError(f"malformed TOML in {p}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FivefoldError(f"cannot read {p}: {exc}") from None


def dumps_toml(data: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(data)


# --------------------------------------------------------------------------------------------
# model


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
            self.head_dim = self.hidden // self.heads
        if self.ffn_hidden == 0:
            self.ffn_hidden = self.expert_ffn_hidden if self.experts else 4 * self.hidden
        if self.experts and self.moe_layers < 0:
            self.moe_layers = self.layers
        if not self.experts:
            self.moe_layers = 0

    # ---- validation
    def validate(self) -> ModelSpec:
        for name in ("layers", "hidden", "heads", "vocab", "ffn_hidden", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise FivefoldError(f"model {self.name}: {name} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise FivefoldError(
                f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads "
                f"({self.kv_heads}); valid kv_heads: {suggest(divisors(self.heads))}"
            )
        if self.head_dim % 2:
            raise FivefoldError(f"model {self.name}: head_dim ({self.head_dim}) must be even for RoPE")
        if self.rope_scaling not in ("none", "llama3"):
            raise FivefoldError(f"model {self.name}: rope_scaling must be none or llama3")
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


# --------------------------------------------------------------------------------------------
# hardware


@dataclass
class HardwareSpec:
    """One accelerator kind and its links. Bandwidths are GB/s per GPU per direction."""

    name: str
    gpu_memory_gb: float
    peak_tflops: float  # dense 16-bit tensor-core peak, vendor-published
    gpus_per_node: int = 8
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 25.0
    hbm_gbps: float = 2000.0
    intra_node_latency_us: float = 3.0
    inter_node_latency_us: float = 10.0
    # achievable fractions (calibrated knobs with a physical meaning; see docs/planner.md)
    matmul_efficiency: float = 0.0  # 0: the planner's default for this peak
    link_efficiency: float = 0.0
    memory_efficiency: float = 0.0  # share of hbm_gbps streaming kernels sustain; 0: planner default
    tdp_w: float = 0.0  # board power the peak is quoted at
    power_limit_w: float = 0.0  # a lower cap set by the operator: clocks drop as its cube root
    attention_efficiency: float = 0.0  # share of the peak attention kernels reach; 0: 0.8 × matmul
    fp8_speedup: float = 0.0  # fp8 matmul rate over the 16-bit one (tensor-core peak ratio 2); 0: default
    # fixed host-side time per optimizer step (optimizer and clipping launches, loss sync); 0: default
    step_overhead_s: float = 0.0

    def validate(self) -> HardwareSpec:
        for name in ("gpu_memory_gb", "peak_tflops", "gpus_per_node", "intra_node_gbps", "inter_node_gbps"):
            if getattr(self, name) <= 0:
                raise FivefoldError(f"hardware {self.name}: {name} must be positive")
        return self


# --------------------------------------------------------------------------------------------
# layout


def complete_order(order: str) -> str:
    """`order` with the axes it leaves out appended in the default order: "cp,tp" -> "cp,tp,fsdp,dp,pp"."""
    if not isinstance(order, str):
        raise FivefoldError(f"--order must be comma-separated axes such as {DEFAULT_ORDER}, got {order!r}")
    given = [a.strip() for a in order.split(",") if a.strip()]
    unknown = [a for a in given if a not in AXES]
    repeated = sorted({a for a in given if given.count(a) > 1})
    if unknown or repeated:
        what = f"unknown axis {', '.join(unknown)}" if unknown else f"{', '.join(repeated)} given twice"
        raise FivefoldError(
            f"--order lists axes innermost first, each at most once, from {','.join(AXES)} "
            f"(the rest follow in the default order {DEFAULT_ORDER}); {what} in {order!r}"
        )
    return ",".join(given + [a for a in DEFAULT_ORDER.split(",") if a not in given])


@dataclass
class Layout:
    """How the world is split. `-1` on dp or fsdp takes whatever the other axes leave."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    zero: int = -1  # -1: 3 when fsdp > 1, else 0
    sp: bool = False
    pp_schedule: str = "1f1b"
    microbatches: int = 0  # 0: pp (or 1 without pipelining)
    virtual_stages: int = 1
    pp_split: str = ""  # manual split: comma-separated layer counts per stage
    cp_impl: str = "ring"
    recompute: str = "none"

    @property
    def world(self) -> int:
        return math.prod(getattr(self, a) for a in AXES)

    @property
    def order_list(self) -> list[str]:
        """Every world axis, innermost first: the given order, then the rest in the default order."""
        return complete_order(self.order).split(",")

    @property
    def data_parallel(self) -> int:
        """Ranks that see different batches (dp × fsdp)."""
        return self.dp * self.fsdp

    def resolve(self, world: int | None = None) -> Layout:
        """Fill -1 factors from the world size, resolve defaults, and validate the factors."""
        lay = dataclasses.replace(self)
        free = [a for a in ("dp", "fsdp") if getattr(lay, a) == -1]
        for a in AXES + ("ep",):
            v = getattr(lay, a)
            if v == 0 or v < -1 or (v == -1 and a not in ("dp", "fsdp")):
                raise FivefoldError(f"--{a} must be a positive integer (or -1 on dp/fsdp), got {v}")
        if len(free) > 1:
            raise FivefoldError("only one of --dp and --fsdp may be -1 (fill the rest)")
        if free:
            if world is None:
                raise FivefoldError(f"--{free[0]} -1 needs a world size (--gpus or --nproc)")
            rest = math.prod(getattr(lay, a) for a in AXES if a != free[0])
            if world % rest:
                raise FivefoldError(
                    f"cannot fill --{free[0]}: the other axes multiply to {rest}, which does not divide "
                    f"the world size {world}"
                )
            setattr(lay, free[0], world // rest)
        if world is not None and lay.world != world:
            raise FivefoldError(
                f"dp×fsdp×cp×tp×pp = {lay.dp}×{lay.fsdp}×{lay.cp}×{lay.tp}×{lay.pp} = {lay.world} must equal "
                f"the world size {world}; e.g. set --fsdp -1 or --dp -1 to fill it, or use world "
                f"{lay.world}"
            )
        lay.order = complete_order(lay.order)
        if lay.zero == -1:
            lay.zero = 3 if lay.fsdp > 1 else 0
        if lay.zero not in (0, 1, 2, 3):
            raise FivefoldError(f"--zero must be 0, 1, 2 or 3, got {lay.zero}")
        if lay.fsdp > 1 and lay.zero in (0, 1):
            raise FivefoldError(
                f"--fsdp {lay.fsdp} shards parameters, so --zero must be 2 or 3 (got {lay.zero}); "
                "for a sharded optimizer on replicated params use --dp N --zero 1"
            )
        if (lay.fsdp * lay.cp) % lay.ep:
            raise FivefoldError(
                f"--ep {lay.ep} must divide fsdp×cp = {lay.fsdp * lay.cp} (expert parallelism re-uses the "
                f"data-parallel ranks); valid ep: {suggest(divisors(lay.fsdp * lay.cp))}"
            )
        if lay.pp_schedule not in PP_SCHEDULES:
            raise FivefoldError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}")
        if lay.recompute not in RECOMPUTE:
            raise FivefoldError(f"--recompute must be one of {', '.join(RECOMPUTE)}")
        if lay.cp_impl not in CP_IMPLS:
            raise FivefoldError(f"--cp-impl must be one of {', '.join(CP_IMPLS)}")
        if lay.virtual_stages < 1:
            raise FivefoldError("--virtual-stages must be >= 1")
        if lay.pp_schedule in ("zbv", "dualpipev") and lay.pp > 1 and lay.virtual_stages not in (1, 2):
            raise FivefoldError(f"--pp-schedule {lay.pp_schedule} uses exactly 2 virtual stages per rank")
        if lay.pp_schedule in ("zbv", "dualpipev") and lay.pp > 1:
            lay.virtual_stages = 2
        if lay.microbatches < 0:
            raise FivefoldError(f"--microbatches must be >= 1 (or 0: the default), got {lay.microbatches}")
        if lay.microbatches == 0:
            lay.microbatches = max(lay.pp, 1) * (1 if lay.pp == 1 else 2)
        if lay.sp and lay.tp == 1:
            lay.sp = False  # sequence parallel is a TP refinement; nothing to shard without TP
        return lay

    def check_model(self, model: ModelSpec, seq_len: int | None = None) -> None:
        """Constraints that depend on the model's shape."""
        if model.heads % self.tp:
            raise FivefoldError(
                f"--tp {self.tp} must divide the {model.heads} attention heads of {model.name}; "
                f"valid tp: {suggest(divisors(model.heads))}"
            )
        if self.tp > model.kv_heads and self.tp % model.kv_heads:
            valid = [d for d in divisors(model.heads) if d <= model.kv_heads or d % model.kv_heads == 0]
            raise FivefoldError(
                f"--tp {self.tp} exceeds kv_heads {model.kv_heads} but is not a multiple of it, so KV heads "
                f"cannot be replicated evenly; valid tp: {suggest(valid)}"
            )
        stages = self.pp * self.virtual_stages
        if stages > model.layers:
            raise FivefoldError(
                f"--pp {self.pp} × --virtual-stages {self.virtual_stages} = {stages} stages exceeds the "
                f"{model.layers} layers of {model.name}; valid pp: "
                f"{suggest([d for d in range(1, model.layers // self.virtual_stages + 1)][:12])}"
            )
        if self.ep > 1:
            if not model.is_moe:
                raise FivefoldError(f"--ep {self.ep} needs a mixture-of-experts model; {model.name} is dense")
            if model.experts % self.ep:
                raise FivefoldError(
                    f"--ep {self.ep} must divide the {model.experts} experts of {model.name}; "
                    f"valid ep: {suggest(divisors(model.experts))}"
                )
        if seq_len is not None and self.cp > 1:
            need = 2 * self.cp if self.cp_impl == "ring" else self.cp
            if seq_len % need:
                raise FivefoldError(
                    f"--seq-len {seq_len} must be divisible by {need} for --cp {self.cp} ({self.cp_impl}: "
                    f"{'two chunks per rank, for balance' if self.cp_impl == 'ring' else 'a chunk per rank'})"
                )
            if self.cp_impl == "ulysses" and model.heads % (self.cp * self.tp):
                raise FivefoldError(
                    f"--cp-impl ulysses splits heads: cp×tp = {self.cp * self.tp} must divide "
                    f"{model.heads} heads"
                )


# --------------------------------------------------------------------------------------------
# training


@dataclass
class TrainSpec:
    steps: int = 300
    seed: int = 0
    dtype: str = "fp32"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables
    seq_len: int = 128
    micro_batch: int = 8  # sequences per rank per forward
    global_batch: int = 0  # sequences per optimizer step; 0: micro_batch × data-parallel ranks
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 0  # 0: only at the end
    data: str = "stdlib"  # stdlib | path to a text file, folder, .jsonl or .bin
    tokenizer: str = "bytes"  # bytes | path to an HF tokenizer.json
    log_every: int = 10
    device: str = "auto"  # auto | cpu | cuda
    # saved-activation meter: a hook on every tensor autograd saves, so it is off unless asked for
    measure_memory_every: int = 0  # 0: never; N: steps 1, N+1, 2N+1, ... (and the last)
    compile: bool = False  # torch.compile each transformer block (fivefold.parallel.compile)

    def validate(self) -> TrainSpec:
        if self.dtype not in DTYPES:
            raise FivefoldError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("steps", "seq_len", "micro_batch"):
            if getattr(self, name) <= 0:
                raise FivefoldError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.global_batch < 0:
            raise FivefoldError("--global-batch must be >= 0")
        if self.measure_memory_every < 0:
            raise FivefoldError(
                "--measure-memory-every must be >= 0 (0: off, 1: every step), "
                f"got {self.measure_memory_every}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise FivefoldError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        positive = {"lr": "--lr", "eps": "eps"}
        for name, flag in positive.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise FivefoldError(f"{flag} must be a positive finite number, got {value}")
        for name in ("weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise FivefoldError(f"{name} must be a finite number >= 0 (0: off), got {value}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise FivefoldError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        at_least = {
            "eval_every": 1,
            "eval_batches": 1,
            "log_every": 1,
            "warmup_steps": 0,
            "checkpoint_every": 0,
        }
        for name, low in at_least.items():
            if getattr(self, name) < low:
                flag = {"warmup_steps": "--warmup"}.get(name, f"--{name.replace('_', '-')}")
                hint = " (0: only at the end)" if name == "checkpoint_every" else ""
                raise FivefoldError(f"{flag} must be >= {low}{hint}, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**63:
            raise FivefoldError(f"--seed must be in 0..2^63-1, got {self.seed}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise FivefoldError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        return self

    def grad_accum(self, data_parallel: int) -> int:
        """Micro-batches each data-parallel rank accumulates per optimizer step."""
        gb = self.global_batch or self.micro_batch * data_parallel
        per = self.micro_batch * data_parallel
        if gb % per:
            ok = [per * k for k in range(1, 9)]
            raise FivefoldError(
                f"--global-batch {gb} must be a multiple of micro_batch × data-parallel ranks = "
                f"{self.micro_batch}×{data_parallel} = {per}; valid: {suggest(ok)}"
            )
        return gb // per


# --------------------------------------------------------------------------------------------
# presets and loading


def _preset_dir(kind: str) -> Any:
    return resources.files("fivefold") / "presets" / kind


def preset_names(kind: str) -> list[str]:
    return sorted(p.name[:-5] for p in _preset_dir(kind).iterdir() if p.name.endswith(".toml"))


def load_model(name_or_path: str) -> ModelSpec:
    """A model preset name, a model TOML, an HF `config.json`, or an HF checkpoint directory."""
    path = Path(name_or_path)
    if name_or_path in preset_names("models"):
        data = tomllib.loads((_preset_dir("models") / f"{name_or_path}.toml").read_text())
        data.setdefault("name", name_or_path)
        return _from_dict(ModelSpec, data, f"model preset {name_or_path}").validate()
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.suffix == ".json":
        if not path.exists():
            raise FivefoldError(f"file not found: {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise FivefoldError(f"malformed JSON in {path}: {exc}") from None
        return model_spec_from_hf(cfg, name=path.parent.name or "hf").validate()
    if path.suffix == ".toml" or path.exists():
        data = read_toml(path)
        data = data.get("model", data)
        data.setdefault("name", path.stem)
        return _from_dict(ModelSpec, data, f"model file {path}").validate()
    raise FivefoldError(
        f"unknown model {name_or_path!r}: not a preset, a .toml, a config.json or an HF directory; "
        f"presets: {suggest(preset_names('models'), 20)}"
    )


def load_hardware(name_or_path: str) -> HardwareSpec:
    if name_or_path in preset_names("hardware"):
        data = tomllib.loads((_preset_dir("hardware") / f"{name_or_path}.toml").read_text())
        data.setdefault("name", name_or_path)
        return _from_dict(HardwareSpec, data, f"hardware preset {name_or_path}").validate()
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        data = read_toml(path)
        data = data.get("hardware", data)
        data.setdefault("name", path.stem)
        return _from_dict(HardwareSpec, data, f"hardware file {path}").validate()
    raise FivefoldError(
        f"unknown hardware {name_or_path!r}; presets: {suggest(preset_names('hardware'))} (or a .toml file)"
    )


_HF_ARCH = (
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "DeepseekV3ForCausalLM",
)


def check_seq_len(model: ModelSpec, seq_len: int) -> None:
    """A run's sequences fit the model's positions (RoPE tables and HF configs are sized for them)."""
    if seq_len > model.max_seq_len:
        raise FivefoldError(
            f"--seq-len {seq_len} exceeds the {model.max_seq_len} positions of model {model.name} "
            f"(max_seq_len); valid: 1..{model.max_seq_len}"
        )


def model_spec_from_hf(cfg: dict[str, Any], name: str = "hf") -> ModelSpec:
    """Translate an HF `config.json` dict (Llama, Mistral, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3)."""
    if not isinstance(cfg, dict):
        raise FivefoldError(f"HF config {name}: expected a JSON object, got {type(cfg).__name__}")
    try:
        return _model_spec_from_hf(cfg, name)
    except KeyError as exc:
        raise FivefoldError(f"HF config {name}: missing key {exc}") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as exc:  # wrong types or zeros
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise FivefoldError(
            f"HF config {name}: a value has the wrong type or is zero ({reason}); sizes and counts "
            "must be positive integers"
        ) from None


def _model_spec_from_hf(cfg: dict[str, Any], name: str) -> ModelSpec:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "")
    if archs and not any(a in _HF_ARCH for a in archs):
        raise FivefoldError(f"unsupported HF architecture {archs}; supported: {', '.join(_HF_ARCH)}")
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
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )
    except KeyError as exc:
        raise FivefoldError(f"HF config {name}: missing key {exc}") from None
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
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
        raise FivefoldError(f"HF config {name}: rope scaling {rtype!r} is not supported (default or llama3)")
    if model_type.startswith("qwen3"):
        spec["qk_norm"] = True
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise FivefoldError(f"HF config {name}: only bias-free SwiGLU MLPs (hidden_act silu) are supported")
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
            q_lora_rank=cfg.get("q_lora_rank") or 0,
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            head_dim=cfg["qk_nope_head_dim"],
        )
    return _from_dict(ModelSpec, spec, f"HF config {name}")


def _qwen3_moe_spec(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """Qwen3-MoE: sparse layers, except a leading run of dense ones (`mlp_only_layers`)."""
    layers = cfg["num_hidden_layers"]
    dense = sorted(cfg.get("mlp_only_layers") or [])
    if cfg.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
        raise FivefoldError(
            f"HF config {name}: only Qwen3-MoE whose dense layers come first (mlp_only_layers = 0..k-1, "
            "decoder_sparse_step = 1) is supported"
        )
    return dict(
        experts=cfg.get("num_experts") or cfg["num_local_experts"],
        experts_per_token=cfg["num_experts_per_tok"],
        expert_ffn_hidden=cfg["moe_intermediate_size"],
        moe_layers=layers - len(dense),
        router_norm_topk=bool(cfg.get("norm_topk_prob", False)),  # HF's default
        aux_loss_coef=cfg.get("router_aux_loss_coef", 0.001),
    )


# --------------------------------------------------------------------------------------------
# CLI plumbing shared by every command


def add_layout_arguments(parser: argparse.ArgumentParser, factors_only: bool = False) -> None:
    """The layout flags, one definition for every command. `factors_only`: the axis sizes and their
    order, for commands that only place ranks (`mesh`) and would ignore the rest."""
    g = parser.add_argument_group("layout")
    for axis, text in (
        ("dp", "replicated data-parallel degree (-1: fill the world)"),
        ("fsdp", "sharded data-parallel degree (-1: fill the world)"),
        ("tp", "tensor-parallel degree (default 1)"),
        ("pp", "pipeline-parallel degree (default 1)"),
        ("cp", "context-parallel degree (default 1)"),
        ("ep", "expert-parallel degree, folded onto fsdp×cp ranks (default 1)"),
    ):
        g.add_argument(f"--{axis}", type=int, default=None, help=text)
    g.add_argument(
        "--order",
        default=None,
        help=f"axes innermost (adjacent ranks) first; any subset, the rest follow in the default order "
        f"(default {DEFAULT_ORDER})",
    )
    if factors_only:
        return
    g.add_argument(
        "--zero",
        type=int,
        default=None,
        choices=(0, 1, 2, 3),
        help="ZeRO stage: 1 shards optimizer state, 2 also grads, 3 also params "
        "(default 3 with fsdp, else 0)",
    )
    g.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallelism on top of tensor parallelism",
    )
    g.add_argument(
        "--pp-schedule",
        default=None,
        choices=PP_SCHEDULES,
        help="pipeline schedule (default 1f1b); interleaved/zbv/dualpipev run several chunks per rank",
    )
    g.add_argument(
        "--microbatches", type=int, default=None, help="pipeline micro-batches per step (default: pp)"
    )
    g.add_argument(
        "--virtual-stages", type=int, default=None, help="model chunks per pipeline rank (default 1)"
    )
    g.add_argument("--pp-split", default=None, help="manual layers per stage, e.g. 3,5,5,3")
    g.add_argument(
        "--cp-impl",
        default=None,
        choices=CP_IMPLS,
        help="context-parallel attention: ring passes K/V blocks rank to rank, allgather gathers them, "
        "ulysses trades sequence for heads with all-to-all (default ring)",
    )
    g.add_argument(
        "--recompute",
        default=None,
        choices=RECOMPUTE,
        help="activation recomputation: full re-runs each block in the backward, selective only the "
        "attention core (default none)",
    )


def layout_from_args(args: argparse.Namespace, base: Layout | None = None) -> Layout:
    """Overlay the layout flags that were given on `base` (unresolved: call .resolve(world))."""
    lay = dataclasses.replace(base) if base else Layout()
    for f in fields(Layout):
        value = getattr(args, f.name, None)
        if value is not None:
            setattr(lay, f.name, value)
    return lay


@dataclass
class RunConfig:
    """Everything a training run needs; written as `config.toml` in the run directory."""

    model: ModelSpec
    train: TrainSpec = field(default_factory=TrainSpec)
    layout: Layout = field(default_factory=Layout)

    def to_toml(self) -> str:
        return dumps_toml(
            {"model": to_dict(self.model), "train": to_dict(self.train), "layout": to_dict(self.layout)}
        )

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        data = read_toml(path)
        if "model" not in data:
            raise FivefoldError(f"{path}: a run config needs a [model] table")
        return cls(
            model=_from_dict(ModelSpec, data["model"], f"{path} [model]").validate(),
            train=_from_dict(TrainSpec, data.get("train", {}), f"{path} [train]").validate(),
            layout=_from_dict(Layout, data.get("layout", {}), f"{path} [layout]"),
        )
