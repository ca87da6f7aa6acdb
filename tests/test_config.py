"""Presets, run-config TOML with flag overrides, the resolved config.toml, and validation errors."""

from __future__ import annotations

import argparse

import pytest

from fivefold.commands.train import add_arguments, build_run_config
from fivefold.config import (
    HardwareSpec,
    ModelSpec,
    RunConfig,
    TrainSpec,
    load_hardware,
    load_model,
    preset_names,
)
from fivefold.errors import FivefoldError

MODEL_PRESETS = [
    "tiny",
    "tiny-moe",
    "small",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "deepseek-v3",
]
HARDWARE_PRESETS = [
    "a100-80gb",
    "a100-40gb",
    "h100-80gb",
    "h200",
    "b200",
    "v100-32gb",
    "mi250x",
    "mi300x",
    "tpu-v3",
    "tpu-v4",
    "tpu-v5p",
    "cpu",
    "h800",
    "a800-80gb",
    "h20",
    "tpu-v5e",
    "tpu-v6e",
    "mi325x",
    "gaudi2",
    "gaudi3",
    "l40s",
    "h100-pcie",
    "h100-nvl",
]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_preset_named_in_the_issue_loads():
    assert set(MODEL_PRESETS) <= set(preset_names("models"))
    assert set(HARDWARE_PRESETS) <= set(preset_names("hardware"))
    for name in MODEL_PRESETS:
        assert isinstance(load_model(name), ModelSpec)
    for name in HARDWARE_PRESETS:
        hw = load_hardware(name)
        assert isinstance(hw, HardwareSpec) and hw.peak_tflops > 0 and hw.gpu_memory_gb > 0


@pytest.mark.parametrize(
    ("name", "billions"),
    [("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.9), ("mixtral-8x7b", 46.7)],
)
def test_large_presets_have_their_published_sizes(name, billions):
    assert load_model(name).num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_moe_presets_count_active_parameters():
    mixtral = load_model("mixtral-8x7b")
    assert mixtral.num_params(active=True) / 1e9 == pytest.approx(12.9, rel=0.02)
    qwen = load_model("qwen3-30b-a3b")
    assert qwen.num_params(active=True) / 1e9 == pytest.approx(3.3, rel=0.05)


def test_run_config_file_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'model = "tiny"\n[train]\nsteps = 7\nlr = 1e-3\nseq_len = 64\n[layout]\nrecompute = "full"\n'
    )
    cfg = build_run_config(parse("--config", str(path)))
    assert cfg.model.name == "tiny" and cfg.train.steps == 7 and cfg.train.lr == 1e-3
    assert cfg.layout.recompute == "full"
    cfg = build_run_config(
        parse(
            "--config",
            str(path),
            "--steps",
            "9",
            "--warmup",
            "3",
            "--dtype",
            "bf16",
            "--recompute",
            "selective",
            "--model",
            "small",
        )
    )
    assert cfg.model.name == "small" and cfg.train.steps == 9 and cfg.train.warmup_steps == 3
    assert cfg.train.dtype == "bf16" and cfg.train.lr == 1e-3 and cfg.layout.recompute == "selective"


def test_model_table_in_a_run_config(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 256\n")
    cfg = build_run_config(parse("--config", str(path)))
    assert (cfg.model.layers, cfg.model.kv_heads, cfg.model.head_dim, cfg.model.ffn_hidden) == (2, 4, 16, 256)


def test_the_defaults_are_the_demo():
    cfg = build_run_config(parse())
    assert cfg.model.name == "small" and cfg.train == TrainSpec()


def test_resolved_config_round_trips(tmp_path):
    cfg = RunConfig(model=load_model("tiny-moe"), train=TrainSpec(steps=5, dtype="bf16"))
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    again = RunConfig.from_toml(tmp_path / "config.toml")
    assert again.model == cfg.model and again.train == cfg.train and again.layout == cfg.layout


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[train]\nsteps = 0\n", "--steps must be positive"),
        ("[train]\nsteps = 100000000000\n", "--steps must be at most 1,000,000,000"),
        (
            "[train]\nseq_len = 0\n",
            r"--seq-len must be positive, got 0 \(set by seq_len in .*bad.toml \[train\]\)",
        ),
        ('[train]\ndtype = "fp8"\n', "--dtype must be one of"),
        ("[train]\nsteps = 2.5\n", "steps must be int"),
        ("[trian]\nsteps = 2\n", "unknown table"),
        ("[model]\nlayers = 2\nhidden = 48\nheads = 6\nkv_heads = 4\nvocab = 256\n", "multiple of kv_heads"),
        (
            "[model]\nlayers = 2\nhidden = 33\nheads = 4\nvocab = 256\n",
            "not a multiple of heads .4.*valid heads: 1, 3",
        ),
        ("[model]\nlayers = 2\nhidden = 64\n", "missing"),
        ("[model]\nlayers = 2\nhidden = 64\n", "required: layers, hidden, heads, vocab"),
        # `true` is an int to Python and "no" a truthy string: neither is what the file means
        ("[model]\nlayers = true\nhidden = 64\nheads = 4\nvocab = 256\n", "layers must be int"),
        ('[layout]\nsp = "no way"\n', "sp must be bool"),
        ("[model]\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 256\nnorm_eps = nan\n", "norm_eps must be"),
        # values past any model's: slips that trained NaN, or flat, with advice about --lr
        ("[model]\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 256\ninit_std = 1e300\n", "init_std must be"),
        ("[model]\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 256\nnorm_eps = 1e300\n", "at most 0.1"),
        ("[model]\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 256\nrope_theta = 1e-300\n", "above 1"),
        # a name heads every table and names the default run directory: no terminal escapes in it
        ('[model]\nname = "a\\u001b[31mred"\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 256\n', "control"),
        ("[model]\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 256\nexperts = -2\n", "experts must be 0"),
        # latent attention's sizes come together: half given, a plan had read an output projection of 0
        ("[model]\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 256\nkv_lora_rank = 32\n", "needs v_head_dim"),
        ("[model]\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 256\nv_head_dim = 16\n", "give kv_lora_rank"),
    ],
)
def test_invalid_run_configs_name_the_constraint(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(FivefoldError, match=message):
        build_run_config(parse("--config", str(path)))


def test_layout_validation_names_valid_values():
    cfg = build_run_config(parse("--model", "tiny", "--tp", "3"))
    with pytest.raises(FivefoldError, match="valid tp: 1, 2, 4"):
        cfg.layout.resolve(3).check_model(cfg.model, 32)
    with pytest.raises(FivefoldError, match="cannot fill --dp: the other axes multiply to 3"):
        cfg.layout.resolve(4)  # dp fills what tp leaves, as in plan
    explicit = build_run_config(parse("--model", "tiny", "--tp", "3", "--dp", "1"))
    with pytest.raises(FivefoldError, match="must equal the world size 4"):
        explicit.layout.resolve(4)


@pytest.mark.parametrize("count", [True, -1, 1.5, "2"])
def test_recompute_layers_is_a_count_of_blocks(count) -> None:
    """`recompute_layers = true` in a config file is not one block: every non-count is refused."""
    from fivefold.config import Layout

    with pytest.raises(FivefoldError, match="count of blocks"):
        Layout(recompute="full", recompute_layers=count).resolve(1)
    assert Layout(recompute="full", recompute_layers=2).resolve(1).recompute_label.startswith("full (first 2")


def test_order_takes_any_subset_and_appends_the_rest_in_the_default_order():
    from fivefold.config import DEFAULT_ORDER, Layout, complete_order

    assert complete_order("fsdp") == "fsdp,tp,cp,dp,pp"
    assert complete_order("pp,dp") == "pp,dp,tp,cp,fsdp"
    assert complete_order("") == DEFAULT_ORDER
    lay = Layout(tp=2, fsdp=2, order="fsdp").resolve(4)
    assert lay.order == "fsdp,tp,cp,dp,pp" and lay.order_list[0] == "fsdp"
    for bad in ("tp,tp", "xx", "tp,cp,fsdp,dp,pp,ep"):
        with pytest.raises(FivefoldError, match="--order"):
            complete_order(bad)
