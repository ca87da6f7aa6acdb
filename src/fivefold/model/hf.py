"""HF checkpoint interop: read and write `config.json` + safetensors directories.

fivefold's parameter names are HF Llama's, so dense weights map one to one. Mixture-of-experts
layers differ only in how experts are stored; every on-disk form below is read into fivefold's
stacked `mlp.experts.{gate,up,down}_proj` [E, out, in]:

  * Mixtral, per expert:     `block_sparse_moe.experts.N.w1|w3|w2.weight` (gate, up, down), router
                             `block_sparse_moe.gate.weight`; this is what transformers 5 still writes;
  * Qwen3-MoE, per expert:   `mlp.experts.N.gate_proj|up_proj|down_proj.weight`;
  * transformers 5 in memory: `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and
                             `mlp.experts.down_proj` [E, H, I];
  * fivefold's own stacked names.

Export writes the per-expert forms (what `save_pretrained` writes and every transformers version
reads). HF orders each head's q and k features for its rotate-half rotary (feature i pairs with
i + d/2); fivefold's rotary turns adjacent pairs (Meta's layout, one complex multiply), so the rows
of q_proj, k_proj (and their biases and q/k norms) are permuted on the way in and back on the way
out: the scores, hence the outputs, are the same. Tensors are read one at a time from memory-mapped
files, so loading needs about one copy of the model.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from fivefold.config import ModelSpec, load_model
from fivefold.errors import FivefoldError
from fivefold.model.attention import RotaryEmbedding, rope_inverse_frequencies
from fivefold.model.moe import MoE
from fivefold.model.transformer import Transformer, build_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_EXPERT_KEY = re.compile(
    r"^(?P<layer>model\.layers\.\d+\.mlp\.experts)\.(?P<index>\d+)\."
    r"(?P<kind>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_PER_EXPERT_KIND = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_ROTARY_ROWS = tuple(
    f".self_attn.{part}" for part in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
) + (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")


# what to do about a training checkpoint that cannot be served
EARLIER_CHECKPOINT = "generate from an earlier checkpoint (--checkpoint STEP)"
NON_FINITE_CHECKPOINT = f"its training diverged or the file is damaged: {EARLIER_CHECKPOINT}"


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating tensor holding NaN or inf (a DTensor: this rank's shard)."""
    for name, tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            return name
    return None


def refuse_non_finite(tensors: Iterable[tuple[str, torch.Tensor]], where: object, remedy: str) -> None:
    """A weight that is not all finite numbers (a diverged run, a damaged file) would generate
    garbage or fail deep in sampling: refuse it by name."""
    name = first_non_finite(tensors)
    if name is not None:
        raise FivefoldError(f"{where}: weight {name} holds NaN or infinite values; {remedy}")


def rotary_rows(name: str, tensor: torch.Tensor, head_dim: int, to_hf: bool = False) -> torch.Tensor:
    """q/k rows from HF's rotate-half order into adjacent rotary pairs (`to_hf`: back): within each
    head, feature i and i + d/2 become 2i and 2i + 1. Other tensors pass through."""
    if not name.endswith(_ROTARY_ROWS):
        return tensor
    rest = tensor.shape[1:]
    split = (2, head_dim // 2) if not to_hf else (head_dim // 2, 2)
    return tensor.reshape(-1, *split, *rest).transpose(1, 2).reshape(tensor.shape)


# --------------------------------------------------------------------------------------------
# loading


def load_hf(
    path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"
) -> tuple[ModelSpec, Transformer]:
    """Read an HF checkpoint directory into a fivefold model (eval mode).

    `dtype` None keeps the checkpoint's floating dtype; otherwise weights are cast to it.
    """
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FivefoldError(f"{root} is not an HF checkpoint directory: it has no config.json")
    spec = load_model(str(root))
    files = safetensors_files(root)
    target = _resolve_dtype(dtype) if dtype is not None else _checkpoint_dtype(files)
    model = empty_model(spec, target, device)

    slots = model.state_dict(keep_vars=True)
    loaded: set[str] = set()
    for name, tensor in _fivefold_tensors(_read_tensors(files)):
        if name == "lm_head.weight" and spec.tie_embeddings:
            continue  # tied: the embedding is the head
        slot = slots.get(name)
        if slot is None:
            raise FivefoldError(
                f"{root}: tensor {name!r} has no place in a {spec.name} model of this config "
                f"(e.g. a bias or layer the architecture here does not have)"
            )
        if tuple(slot.shape) != tuple(tensor.shape):
            raise FivefoldError(
                f"{root}: tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(slot.shape)}"
            )
        refuse_non_finite([(name, tensor)], root, "this checkpoint cannot be served as it is")
        with torch.no_grad():
            slot.copy_(rotary_rows(name, tensor, spec.head_dim))
        loaded.add(name)
    optional = {n for n in slots if n.endswith(".expert_bias")}
    if spec.tie_embeddings:
        optional.add("lm_head.weight")
    missing = sorted(set(slots) - loaded - optional)
    if missing:
        shown = ", ".join(missing[:5]) + (f", … ({len(missing) - 5} more)" if len(missing) > 5 else "")
        raise FivefoldError(f"{root}: the checkpoint lacks {len(missing)} tensor(s): {shown}")
    return spec, model.eval()


def safetensors_files(root: Path) -> list[Path]:
    """The weight files of a checkpoint: those of the shard index, else every *.safetensors."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map.values())
            if not all(isinstance(name, str) for name in names):
                raise ValueError("weight_map values must be file names")
            # shards live beside the index: a path (../x, /etc/x) would read files the checkpoint
            # does not own
            outside = sorted(n for n in names if not n or Path(n).name != n or n in (".", ".."))
            if outside:
                raise ValueError(f"shard names must be file names in its directory, not {outside[0]!r}")
        except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
            raise FivefoldError(f"malformed shard index {index}: {exc}") from None
        files = [root / f for f in sorted(names)]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FivefoldError(f"{index} names shard(s) that are not there: {', '.join(absent)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        hint = (
            " (only PyTorch .bin weights found; re-save with safe_serialization)"
            if any(root.glob("*.bin"))
            else ""
        )
        raise FivefoldError(f"{root}: no *.safetensors weight files{hint}")
    return files


def _read_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:  # memory-mapped
                for key in reader.keys():  # noqa: SIM118 (a reader, not a dict)
                    yield key, reader.get_tensor(key)
        except SafetensorError as exc:
            raise FivefoldError(f"cannot read {file}: {exc}") from None


def _fivefold_tensors(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename HF keys to fivefold's and stack per-expert weights (once all experts of a layer are read)."""
    per_expert: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for key, tensor in tensors:
        key = key.replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT_KEY.match(key)
        if match:
            kind = _PER_EXPERT_KIND.get(match["kind"], match["kind"])
            per_expert[f"{match['layer']}.{kind}"][int(match["index"])] = tensor
        elif key.endswith(".mlp.experts.gate_up_proj"):
            if tensor.dim() != 3 or tensor.shape[1] % 2:  # [experts, 2·ffn, hidden]
                raise FivefoldError(
                    f"{key}: a fused expert gate/up weight has 3 dimensions, the second 2 × ffn; "
                    f"got shape {list(tensor.shape)}"
                )
            gate, up = tensor.chunk(2, dim=1)
            yield key.replace("gate_up_proj", "gate_proj"), gate
            yield key.replace("gate_up_proj", "up_proj"), up
        elif key.endswith("rotary_emb.inv_freq"):
            continue  # some old checkpoints store the rotary table; it is recomputed
        else:
            yield key, tensor
    for name, experts in per_expert.items():
        if sorted(experts) != list(range(len(experts))):
            found = sorted(experts)
            raise FivefoldError(f"experts of {name} are not numbered 0..{len(experts) - 1}: {found}")
        yield name, torch.stack([experts[i] for i in range(len(experts))])


def _checkpoint_dtype(files: list[Path]) -> torch.dtype:
    for _, tensor in _read_tensors(files[:1]):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise FivefoldError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def empty_model(spec: ModelSpec, dtype: torch.dtype, device: str | torch.device) -> Transformer:
    """Allocate (uninitialised) weights in `dtype`; keep routing and rotary state in fp32."""
    model = build_model(spec, "meta").to(dtype)
    model.to_empty(device=device)
    if spec.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = rope_inverse_frequencies(spec).to(device)
        if isinstance(module, MoE):
            module.gate.expert_bias = torch.zeros(spec.experts, device=device)
            module.tokens_per_expert = torch.zeros(spec.experts, device=device)
    return model


# --------------------------------------------------------------------------------------------
# export


def export_hf(
    model: Transformer, spec: ModelSpec, out_dir: str | Path, dtype: torch.dtype | str | None = None
) -> Path:
    """Write `config.json` + `model.safetensors` that `AutoModelForCausalLM.from_pretrained` loads.

    Dense models become Llama (Qwen3 with q/k norms); MoE models Mixtral (Qwen3-MoE with q/k norms).
    Raises FivefoldError for what those architectures cannot express.
    """
    from safetensors.torch import save_file

    config = hf_config(spec)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if torch.count_nonzero(moe.gate.expert_bias):
            raise FivefoldError(
                "this model routes with a trained auxiliary-loss-free bias, which HF "
                f"{config['architectures'][0]} has no place for; export would change its outputs"
            )
    target = _resolve_dtype(dtype) if dtype is not None else None
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(".expert_bias") or (name == "lm_head.weight" and spec.tie_embeddings):
            continue
        tensor = tensor.detach().to("cpu", target) if target else tensor.detach().cpu()
        tensor = rotary_rows(name, tensor, spec.head_dim, to_hf=True)
        for hf_name, piece in _hf_tensors(name, tensor, config["model_type"]):
            tensors[hf_name] = piece.contiguous().clone()  # own storage: safetensors refuses shared
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config["torch_dtype"] = config["dtype"] = str(target or tensors["model.embed_tokens.weight"].dtype)[6:]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _hf_tensors(name: str, tensor: torch.Tensor, model_type: str) -> Iterator[tuple[str, torch.Tensor]]:
    layer, sep, kind = name.rpartition(".mlp.experts.")
    if not sep:
        if model_type == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        yield name, tensor
        return
    for index, weight in enumerate(tensor.unbind(0)):
        if model_type == "mixtral":
            legacy = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[kind]
            yield f"{layer}.block_sparse_moe.experts.{index}.{legacy}.weight", weight
        else:
            yield f"{layer}.mlp.experts.{index}.{kind}.weight", weight


def hf_config(spec: ModelSpec) -> dict:
    """The HF `config.json` dict for `spec` (the inverse of `config.model_spec_from_hf`)."""
    if spec.is_mla:
        raise FivefoldError(f"{spec.name}: multi-head latent attention has no HF export here")
    config: dict = {
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn_hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": spec.norm_eps,
        "tie_word_embeddings": spec.tie_embeddings,
        "attention_bias": spec.attention_bias,
        "hidden_act": "silu",
        "initializer_range": spec.init_std,
    }
    if spec.attention_bias:
        raise FivefoldError(f"{spec.name}: HF's attention_bias also puts a bias on o_proj; not exportable")
    config.update(_rope_config(spec))
    if not spec.is_moe:
        arch, model_type = ("Qwen3ForCausalLM", "qwen3") if spec.qk_norm else ("LlamaForCausalLM", "llama")
    else:
        arch, model_type = _moe_architecture(spec)
        config.update(num_experts_per_tok=spec.experts_per_token, router_aux_loss_coef=spec.aux_loss_coef)
        if model_type == "mixtral":
            config.update(num_local_experts=spec.experts, intermediate_size=spec.expert_ffn_hidden)
        else:
            config.update(
                num_experts=spec.experts,
                moe_intermediate_size=spec.expert_ffn_hidden,
                norm_topk_prob=spec.router_norm_topk,
                decoder_sparse_step=1,
                mlp_only_layers=list(range(spec.first_moe_layer)),
            )
    return {"architectures": [arch], "model_type": model_type, **config}


def _moe_architecture(spec: ModelSpec) -> tuple[str, str]:
    problems = []
    if spec.router_score != "softmax":
        problems.append("sigmoid router scores (HF Mixtral/Qwen3-MoE use softmax)")
    if spec.shared_experts:
        problems.append("a shared expert")
    if spec.qk_norm:
        return ("Qwen3MoeForCausalLM", "qwen3_moe") if not problems else _refuse(spec, problems)
    if not spec.router_norm_topk:
        problems.append("un-normalised top-k weights (Mixtral always renormalises)")
    if spec.moe_layers != spec.layers:
        problems.append("dense layers among MoE layers (Mixtral has none)")
    return ("MixtralForCausalLM", "mixtral") if not problems else _refuse(spec, problems)


def _refuse(spec: ModelSpec, problems: list[str]) -> tuple[str, str]:
    raise FivefoldError(
        f"{spec.name} cannot be exported to an HF MoE architecture: it has {'; '.join(problems)}"
    )


def _rope_config(spec: ModelSpec) -> dict:
    # transformers 5 reads `rope_parameters`; older versions `rope_theta` + `rope_scaling`
    params: dict = {"rope_type": "default", "rope_theta": spec.rope_theta}
    legacy_scaling = None
    if spec.rope_scaling == "llama3":
        legacy_scaling = {
            "rope_type": "llama3",
            "factor": spec.rope_factor,
            "low_freq_factor": spec.rope_low_freq_factor,
            "high_freq_factor": spec.rope_high_freq_factor,
            "original_max_position_embeddings": spec.rope_original_max_len,
        }
        params.update(legacy_scaling)
    return {"rope_theta": spec.rope_theta, "rope_scaling": legacy_scaling, "rope_parameters": params}
