"""An HF config.json of an architecture fivefold does not build is planned by its shape, and refused
(one line, before anything starts) by the commands that would have to build it."""

from __future__ import annotations

import json

import pytest

from fivefold.cli import main
from fivefold.config import load_model_shape
from fivefold.plan.spec import resolve_arch, total_params

# configs as their model cards publish them (sizes only), with each card's parameter count
CONFIGS = {
    "gpt2": (
        {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": 768,
            "n_head": 12,
            "n_layer": 12,
            "n_positions": 1024,
            "vocab_size": 50257,
        },
        0.124e9,
    ),
    "neox-20b": (
        {
            "architectures": ["GPTNeoXForCausalLM"],
            "model_type": "gpt_neox",
            "hidden_size": 6144,
            "intermediate_size": 24576,
            "num_attention_heads": 64,
            "num_hidden_layers": 44,
            "vocab_size": 50432,
            "max_position_embeddings": 2048,
        },
        20.55e9,
    ),
    "gemma2-9b": (
        {
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "hidden_size": 3584,
            "intermediate_size": 14336,
            "num_hidden_layers": 42,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "vocab_size": 256000,
            "hidden_activation": "gelu",
        },
        9.24e9,
    ),
    "qwen2-7b": (
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "tie_word_embeddings": False,
        },
        7.62e9,
    ),
    "olmoe-1b-7b": (
        {
            "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe",
            "hidden_size": 2048,
            "intermediate_size": 1024,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "vocab_size": 50304,
        },
        6.92e9,
    ),
    "deepseek-v2-lite": (
        {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "vocab_size": 102400,
        },
        15.7e9,
    ),
    "falcon-7b": (
        {
            "architectures": ["FalconForCausalLM"],
            "model_type": "falcon",
            "hidden_size": 4544,
            "num_attention_heads": 71,
            "num_hidden_layers": 32,
            "vocab_size": 65024,
            "multi_query": True,
        },
        6.92e9,
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_other_architectures_are_planned_by_their_shape(name: str, tmp_path) -> None:
    cfg, card = CONFIGS[name]
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    spec, note = load_model_shape(str(path))
    assert cfg["architectures"][0] in note and "train refuses it" in note
    arch = resolve_arch(spec)
    assert total_params(spec, arch) == pytest.approx(card, rel=0.01)
    # the MLP's matrices as the model has them: two around a GELU, three where it is gated
    assert arch.gated_mlp == (cfg["model_type"] not in ("gpt2", "gpt_neox", "falcon"))


def test_plan_reads_the_shape_and_train_verify_generate_refuse_it_first(tmp_path, capsys) -> None:
    folder = tmp_path / "neox"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS["neox-20b"][0]))
    assert main(["plan", "--model", str(folder), "--gpus", "8", "--hardware", "h100-80gb", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["params"] == pytest.approx(20.55e9, rel=0.01)
    assert "GPTNeoXForCausalLM is planned by its shape" in out.err
    assert main(["train", "--model", str(folder), "--steps", "1", "--run-dir", str(tmp_path / "r")]) == 2
    assert "unsupported HF architecture" in capsys.readouterr().err
    # a model file that asks for a GELU MLP: planned, and refused by every command that builds one
    gelu = tmp_path / "gelu.toml"
    gelu.write_text(
        '[model]\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 256\nffn_hidden = 256\nmlp = "gelu"\n'
    )
    assert main(["plan", "--model", str(gelu), "--gpus", "2", "--hardware", "cpu", "--json"]) == 0
    assert "builds SwiGLU blocks only" in capsys.readouterr().err  # planned, and said so
    for argv in (
        ["train", "--model", str(gelu), "--steps", "1", "--run-dir", str(tmp_path / "g")],
        ["verify", "--model", str(gelu), "--nproc", "2", "--fsdp", "2"],
        ["generate", "--model", str(gelu), "--prompt", "hi"],
        ["generate", "--model", str(gelu), "--prompt", "hi", "--nproc", "2", "--tp", "2"],
    ):
        assert main(argv) == 2, argv
        assert "builds SwiGLU blocks only" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()


def test_latent_attention_is_planned_and_train_verify_generate_refuse_it(tmp_path, capsys) -> None:
    """The runtime builds grouped-query attention only: a model with multi-head latent attention
    (a DeepSeek-V3 config.json, or a model file with kv_lora_rank) would train a different network."""
    mla = tmp_path / "mla.toml"
    mla.write_text(
        "layers = 2\nhidden = 32\nheads = 4\nvocab = 256\nffn_hidden = 64\nkv_lora_rank = 16\n"
        "qk_rope_head_dim = 4\nv_head_dim = 8\n"
    )
    v3 = tmp_path / "v3"
    v3.mkdir()
    (v3 / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "hidden_size": 64,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "first_k_dense_replace": 1,
                "kv_lora_rank": 16,
                "q_lora_rank": None,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                "vocab_size": 300,
            }
        )
    )
    for model in (mla, v3):
        spec, note = load_model_shape(str(model))
        assert spec.is_mla and "builds grouped-query attention only" in note  # planned, and said so
        for argv in (
            ["train", "--model", str(model), "--steps", "1", "--run-dir", str(tmp_path / "r")],
            ["verify", "--model", str(model), "--nproc", "2", "--fsdp", "2"],
            ["generate", "--model", str(model), "--prompt-ids", "1"],
        ):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert "multi-head latent attention" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()
