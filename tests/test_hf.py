"""fivefold against HF transformers on the same random weights: logits, greedy tokens, load and export.

Every HF model is built here from a small config with random weights (no downloads), saved with
`save_pretrained`, and read back with `load_hf`; the reference is transformers' own forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from fivefold.errors import FivefoldError  # noqa: E402
from fivefold.model.generate import generate  # noqa: E402
from fivefold.model.hf import export_hf, hf_config, load_hf  # noqa: E402

COMMON = dict(
    vocab_size=96,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    initializer_range=0.1,  # larger than HF's default so logits are far from uniform
)


def _llama(tied: bool, kv_heads: int) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(
        **COMMON,
        intermediate_size=80,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )


def _mixtral() -> transformers.PretrainedConfig:
    return transformers.MixtralConfig(
        **COMMON, intermediate_size=40, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    )


def _qwen3_moe(norm_topk: bool = False) -> transformers.PretrainedConfig:
    return transformers.Qwen3MoeConfig(
        **(COMMON | {"num_hidden_layers": 3}),
        intermediate_size=64,
        moe_intermediate_size=24,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk,
        mlp_only_layers=[0],  # a dense first layer, then MoE
    )


def _qwen3() -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(**COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=16)


def _mistral() -> transformers.PretrainedConfig:
    return transformers.MistralConfig(
        **COMMON, intermediate_size=80, num_key_value_heads=1, sliding_window=None
    )


CASES = {
    "llama-untied-gqa": lambda: _llama(tied=False, kv_heads=2),
    "llama-tied-mha": lambda: _llama(tied=True, kv_heads=4),
    "mixtral": _mixtral,
    "qwen3-moe": _qwen3_moe,
    "qwen3": _qwen3,
    "mistral": _mistral,
}


def _hf_model(config: transformers.PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _ids(vocab: int, batch: int = 2, seq: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    """(case, HF model, its save_pretrained directory)."""
    hf = _hf_model(CASES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


@torch.no_grad()
def test_logits_match_hf(saved) -> None:
    case, hf, path = saved
    spec, model = load_hf(path)
    assert spec.tie_embeddings == hf.config.tie_word_embeddings
    ids = _ids(spec.vocab)
    expected = hf(ids).logits
    assert expected.std() > 0.1  # the comparison below is not between near-constant logits
    torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=0)


def test_greedy_generation_matches_hf(saved) -> None:
    case, hf, path = saved
    _, model = load_hf(path)
    prompt = _ids(hf.config.vocab_size, batch=2, seq=6, seed=3)
    expected = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),  # else HF masks prompt tokens equal to pad_token_id
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[:, prompt.shape[1] :]
    ours = generate(model, prompt, 12, greedy=True)
    assert torch.equal(ours, expected), case
    # the KV cache changes nothing: the cached decode equals re-running the whole sequence
    full = torch.cat((prompt, ours), dim=1)
    with torch.no_grad():
        recomputed = model(full[:, :-1]).argmax(-1)[:, prompt.shape[1] - 1 :]
    assert torch.equal(recomputed, ours)


@torch.no_grad()
def test_export_reloads_in_transformers(saved, tmp_path) -> None:
    case, hf, path = saved
    spec, model = load_hf(path)
    export_hf(model, spec, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    # a dense model without q/k norms is written as Llama, Mistral included (the same computation)
    assert type(again) is (transformers.LlamaForCausalLM if case == "mistral" else type(hf))
    ids = _ids(spec.vocab, seed=5)
    torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
    # and the export reads back into fivefold with the same spec
    spec2, model2 = load_hf(tmp_path)
    assert spec2 == spec.__class__(**{**spec.__dict__, "name": spec2.name})
    torch.testing.assert_close(model2(ids), model(ids), atol=0, rtol=0)


@torch.no_grad()
def test_sharded_checkpoint(tmp_path) -> None:
    hf = _hf_model(_llama(tied=False, kv_heads=2))
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    _, model = load_hf(tmp_path)
    ids = _ids(96)
    torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["mixtral", "qwen3-moe"])
@torch.no_grad()
def test_stacked_expert_layout(case, tmp_path) -> None:
    """transformers 5 holds experts stacked (`gate_up_proj`); a file written in that form loads too."""
    hf = _hf_model(CASES[case]())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    hf.config.to_json_file(tmp_path / "config.json")
    _, model = load_hf(tmp_path)
    ids = _ids(96)
    torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=0)


def test_dtype_kept_or_cast(tmp_path) -> None:
    hf = _hf_model(_llama(tied=True, kv_heads=2)).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    _, kept = load_hf(tmp_path)
    assert kept.model.embed_tokens.weight.dtype == torch.bfloat16
    assert kept.model.rotary_emb.inv_freq.dtype == torch.float32
    _, cast = load_hf(tmp_path, dtype="fp32")
    assert cast.lm_head.weight.dtype == torch.float32
    assert cast.lm_head.weight is cast.model.embed_tokens.weight
    torch.testing.assert_close(cast.model.embed_tokens.weight, hf.model.embed_tokens.weight.float())


def test_bad_checkpoints(tmp_path) -> None:
    with pytest.raises(FivefoldError, match="no config.json"):
        load_hf(tmp_path)
    hf = _hf_model(_llama(tied=False, kv_heads=2))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"intermediate_size": 64}))
    with pytest.raises(FivefoldError, match="shape"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    with pytest.raises(FivefoldError, match="lacks"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FivefoldError, match="no \\*.safetensors"):
        load_hf(tmp_path)


def test_unexportable_moe_is_refused() -> None:
    from fivefold.config import load_model

    with pytest.raises(FivefoldError, match="shared expert"):
        hf_config(load_model("tiny-moe"))


def test_a_shard_index_cannot_reach_outside_its_directory_and_non_finite_weights_are_refused(
    tmp_path,
) -> None:
    hf = _hf_model(_llama(tied=False, kv_heads=2))
    elsewhere, root = tmp_path / "other", tmp_path / "ckpt"
    hf.save_pretrained(elsewhere)
    hf.save_pretrained(root, max_shard_size="40KB")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    for name in ("../other/model.safetensors", str(elsewhere / "model.safetensors"), ".."):
        key = next(iter(index["weight_map"]))
        changed = dict(index, weight_map=dict(index["weight_map"], **{key: name}))
        (root / "model.safetensors.index.json").write_text(json.dumps(changed))
        with pytest.raises(FivefoldError, match="shard names must be file names in its directory"):
            load_hf(root)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state["model.layers.0.mlp.up_proj.weight"][3, 1] = float("inf")
    safetensors_torch.save_file(state, str(elsewhere / "model.safetensors"))
    with pytest.raises(FivefoldError, match="weight model.layers.0.mlp.up_proj.weight holds NaN"):
        load_hf(elsewhere)
