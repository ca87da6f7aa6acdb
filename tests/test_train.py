"""The training loop on one process: determinism, learning, accumulation, bf16, recompute, memory."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fivefold.config import Layout, RunConfig, TrainSpec, load_model
from fivefold.errors import FivefoldError
from fivefold.measure.memory import ActivationMeter, state_bytes
from fivefold.model import build_model, lm_loss, materialize
from fivefold.parallel.recompute import apply_recompute, blocks, is_recomputed, recompute_mode
from fivefold.train import lr_at, train
from fivefold.train.plots import read_metrics


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and never stall waiting for a busy core's sibling."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


REQUIRED = {"step", "loss", "tokens_per_s", "mfu", "grad_norm", "lr", "memory"}


def tiny_run(corpus: str, model: str = "tiny", **train) -> RunConfig:
    base = dict(
        steps=4,
        seq_len=32,
        micro_batch=4,
        warmup_steps=2,
        eval_every=1000,
        eval_batches=2,
        data=corpus,
        lr=3e-3,
        device="cpu",
    )
    base.update(train)
    return RunConfig(model=load_model(model), train=TrainSpec(**base))


def test_same_seed_gives_bitwise_the_same_losses(tmp_path, corpus):
    a = train(tiny_run(corpus), tmp_path / "a", progress=False).losses
    b = train(tiny_run(corpus), tmp_path / "b", progress=False).losses
    c = train(tiny_run(corpus, seed=1), tmp_path / "c", progress=False).losses
    assert a == b  # exact float equality, not approx
    assert a != c


def test_loss_falls_and_the_run_directory_is_complete(tmp_path, corpus):
    result = train(tiny_run(corpus, steps=30, eval_every=15), tmp_path / "run", progress=False)
    first, last = result.losses[0], sum(result.losses[-3:]) / 3
    assert abs(first - math.log(256)) < 0.2  # random init: about uniform over 256 bytes
    assert last < first - 0.8
    run = tmp_path / "run"
    for name in ("config.toml", "metrics.jsonl", "trace.json", "loss.png"):
        assert (run / name).exists(), name
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(set(r) >= REQUIRED for r in records)
    assert [r["step"] for r in records if "held_out_loss" in r] == [15, 30]
    assert result.held_out_loss == records[-1]["held_out_loss"] < first
    assert all(r["mfu"] > 0 and r["tokens_per_s"] > 0 for r in records)
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"forward_backward", "optimizer", "eval", "checkpoint"} <= names
    saved = RunConfig.from_toml(run / "config.toml")
    assert saved.train.steps == 30 and saved.train.global_batch == 4 and saved.model.name == "tiny"
    # the facts its plan needs: the threads each rank computed with, the torch whose kernels ran
    facts = json.loads((run / "run.json").read_text())
    assert facts["torch"] == torch.__version__ and facts["threads_per_rank"] == torch.get_num_threads()


def test_lr_schedule_is_warmup_then_cosine():
    t = TrainSpec(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(5, t) == pytest.approx(0.5)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    assert lr_at(110, t) == pytest.approx(0.1)


def test_gradient_accumulation_equals_the_big_batch(tmp_path, corpus):
    big = train(tiny_run(corpus, micro_batch=8, global_batch=8), tmp_path / "big", progress=False).losses
    acc = train(tiny_run(corpus, micro_batch=2, global_batch=8), tmp_path / "acc", progress=False).losses
    assert acc == pytest.approx(big, rel=1e-5, abs=1e-5)
    small = train(tiny_run(corpus, micro_batch=2, global_batch=2), tmp_path / "small", progress=False).losses
    assert small[0] != pytest.approx(big[0], rel=1e-4)  # a different batch really is different


def test_bf16_trains_close_to_fp32(tmp_path, corpus):
    fp32 = train(tiny_run(corpus, steps=3), tmp_path / "fp32", progress=False).losses
    bf16 = train(tiny_run(corpus, steps=3, dtype="bf16"), tmp_path / "bf16", progress=False).losses
    assert all(math.isfinite(v) for v in bf16)
    assert bf16 == pytest.approx(fp32, abs=0.05)
    assert bf16 != fp32  # autocast really ran in bf16


def _grads_and_activations(mode: str, spec, batch, layers: int = 0):
    model = materialize(build_model(spec), "cpu", seed=5)
    apply_recompute(model, mode, layers)
    x, y = batch
    with ActivationMeter() as meter:
        lm_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, meter.peak_bytes, model


def test_activation_meter_counts_no_parameter_seen_through_aliases():
    """A weight reached through views (a transpose of a selected slice, as the per-expert loop uses
    its experts' stacked weights) is the parameter's memory; a cast of it is new memory, saved."""
    weight = torch.nn.Parameter(torch.randn(2, 8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationMeter() as meter:
        x.mul(2).matmul(weight.view_as(weight)[1].t()).sum().backward()
    assert meter.peak_bytes == 4 * 8 * 4  # only x·2, which the matmul saves
    with ActivationMeter() as meter:
        x.mul(2).matmul(weight[1].t().to(torch.float64).float()).sum().backward()
    assert meter.peak_bytes == 4 * 8 * 4 + 8 * 8 * 4  # and the cast copy of the weight


def test_activation_meter_counts_a_received_input_but_no_parameter():
    """A pipeline stage's input arrives as a leaf that requires grad: an activation its first op (or
    that block's checkpoint) saves, not a parameter, though both are leaves."""
    from torch.utils.checkpoint import checkpoint

    weight = torch.nn.Parameter(torch.randn(8, 8))
    received = torch.randn(4, 8).requires_grad_()
    with ActivationMeter() as meter:
        received.matmul(weight).sum().backward()
    assert meter.peak_bytes == 4 * 8 * 4  # the input the matmul saves; the weight is not counted
    with ActivationMeter() as meter:
        checkpoint(lambda t: t.matmul(weight).relu(), received, use_reentrant=False).sum().backward()
    assert meter.peak_bytes == 4 * 8 * 4  # the checkpoint keeps only its input


@pytest.mark.parametrize("model_name", ["tiny", "tiny-moe"])
def test_recompute_gives_the_same_gradients_and_saves_less(model_name):
    spec = load_model(model_name)
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 256, (2, 64), generator=gen), torch.randint(0, 256, (2, 64), generator=gen))
    ref, ref_bytes, _ = _grads_and_activations("none", spec, batch)
    for mode in ("selective", "full"):
        grads, saved, model = _grads_and_activations(mode, spec, batch)
        assert recompute_mode(model) == mode
        assert set(grads) == set(ref)  # parameter names are untouched
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
        assert saved < ref_bytes, mode
    # full keeps only block inputs: much less than selective
    assert (
        _grads_and_activations("full", spec, batch)[1] < _grads_and_activations("selective", spec, batch)[1]
    )


@pytest.mark.parametrize("model_name", ["tiny", "tiny-moe"])
def test_recomputing_some_blocks_gives_the_same_gradients_and_saves_in_between(model_name):
    """Full recompute of the first N blocks: the same gradients, and saved activations that fall
    with N, from keeping everything (N = 0 blocks) to full recompute (every block)."""
    spec = load_model(model_name)
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 256, (2, 64), generator=gen), torch.randint(0, 256, (2, 64), generator=gen))
    ref, kept_all, _ = _grads_and_activations("none", spec, batch)
    saved = [kept_all]
    for n in range(1, spec.layers):
        grads, kept, model = _grads_and_activations("full", spec, batch, layers=n)
        assert [is_recomputed(b) for b in blocks(model)] == [i < n for i in range(spec.layers)]
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
        saved.append(kept)
    saved.append(_grads_and_activations("full", spec, batch)[1])
    assert saved == sorted(saved, reverse=True) and len(set(saved)) == len(saved)
    # as many blocks as the model has, or more, is plain full recompute
    _, _, model = _grads_and_activations("full", spec, batch, layers=spec.layers + 3)
    assert all(is_recomputed(b) for b in blocks(model)) and recompute_mode(model) == "full"


def test_recompute_through_the_loop_matches(tmp_path, corpus):
    base = tiny_run(corpus, steps=3)
    plain = train(base, tmp_path / "none", progress=False).losses
    full = train(replace(base, layout=Layout(recompute="full")), tmp_path / "full", progress=False).losses
    assert full == pytest.approx(plain, rel=1e-6)
    some = Layout(recompute="full", recompute_layers=2)
    assert train(replace(base, layout=some), tmp_path / "some", progress=False).losses == pytest.approx(
        plain, rel=1e-6
    )


def test_moe_model_trains(tmp_path, corpus):
    result = train(tiny_run(corpus, model="tiny-moe", steps=3), tmp_path / "moe", progress=False)
    assert len(result.losses) == 3 and all(math.isfinite(v) for v in result.losses)


def test_state_memory_matches_the_parameter_count(tmp_path, corpus):
    spec = load_model("tiny")
    train(tiny_run(corpus, steps=3, measure_memory_every=2), tmp_path / "m", progress=False)
    records = read_metrics(tmp_path / "m" / "metrics.jsonl")
    memory = records[-1]["memory"]
    # the saved-tensor meter runs only on the steps asked for: 1 and 3 here (the last), not 2
    assert ["activations" in r["memory"] for r in records] == [True, False, True]
    assert memory["params"] == 4 * spec.num_params()  # fp32, closed form from the spec
    assert memory["grads"] == memory["params"]
    assert memory["optimizer"] == 2 * memory["params"]  # AdamW: exp_avg + exp_avg_sq
    assert memory["activations"] > 0


def test_profile_step_writes_a_trace_and_an_op_table(tmp_path, corpus):
    train(tiny_run(corpus, steps=2, profile_step=2), tmp_path / "p", progress=False)
    profile = tmp_path / "p" / "profile"
    trace = json.loads((profile / "rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert any(n and n.startswith("aten::") and "mm" in n for n in names)  # the step's matmuls
    table = (profile / "rank0.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    with pytest.raises(FivefoldError, match="--profile-step must be between 0"):
        TrainSpec(steps=2, profile_step=3).validate()


def test_activation_meter_counts_unique_storages_and_skips_parameters():
    w = torch.nn.Parameter(torch.randn(16, 8))
    x = torch.randn(4, 8)  # 128 bytes
    with ActivationMeter() as meter:
        h = torch.nn.functional.linear(x, w)  # saves x (and w, a parameter: not counted)
        out = (h * h).sum()  # saves h twice: one storage, 4*16*4 = 256 bytes
    assert meter.peak_bytes == x.numel() * 4 + h.numel() * 4
    out.backward()
    del out, h
    assert meter.live_bytes == 0  # everything was released by the backward
    assert state_bytes([torch.nn.Linear(8, 16, bias=False)], None)["params"] == 16 * 8 * 4


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H20", "h20"),
        ("AMD Instinct MI300X", "mi300x"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA GeForce RTX 4090", "h100-80gb"),  # no preset: an H100's peak, as before
    ],
)
def test_mfu_is_counted_against_the_gpus_own_peak(monkeypatch, name, preset):
    """train's MFU and the runs reader name a GPU from one table: an H20 or an MI300X had been
    counted against an H100's peak (6.7× and 0.76× their own)."""
    from fivefold.config import load_hardware
    from fivefold.plan.runs import hardware
    from fivefold.train.metrics import hardware_preset_for

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert hardware_preset_for(torch.device("cuda")) == preset
    if preset != "h100-80gb":  # a published run on the same GPU is planned on the same preset
        assert hardware({"id": "r", "hardware": {"gpu": name}}).name == load_hardware(preset).name


def test_a_diverging_run_stops_before_non_finite_gradients_reach_the_weights(tmp_path, corpus):
    """lr 1e30: step 1 leaves huge but finite weights, step 2's gradients are not finite. The run
    stops there with one line, before the optimizer writes NaN into the weights, so every checkpoint
    it kept holds finite numbers."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from fivefold.train.checkpoint import list_checkpoints

    run = tmp_path / "run"
    with pytest.raises(
        FivefoldError, match=r"the gradient norm became (nan|inf) at step 2 .*lower --lr"
    ) as err:
        train(tiny_run(corpus, steps=6, lr=1e30, warmup_steps=0, checkpoint_every=1), run, progress=False)
    assert "--dtype fp32" not in str(err.value)  # it already is fp32
    ((step, path),) = list_checkpoints(run)
    assert step == 1
    dcp_to_torch_save(path, tmp_path / "step1.pt")
    state = torch.load(tmp_path / "step1.pt", weights_only=True)
    tensors = [
        t for part in state["model"].values() for t in (part.values() if isinstance(part, dict) else [part])
    ]
    assert tensors and all(torch.isfinite(t).all() for t in tensors if torch.is_tensor(t))


def test_weights_that_overflow_are_never_checkpointed_and_a_nan_held_out_loss_fails_the_run(tmp_path, corpus):
    """lr 1e308: step 1's loss and gradients are finite, its update is not. A checkpoint after it
    is refused, and a run whose last held-out loss is NaN does not end as a success."""
    from fivefold.train.checkpoint import list_checkpoints

    run = tmp_path / "ckpt"
    with pytest.raises(
        FivefoldError, match="the weights stopped being finite numbers at step 1, and no checkpoint"
    ):
        train(tiny_run(corpus, steps=3, lr=1e308, warmup_steps=0, checkpoint_every=1), run, progress=False)
    assert list_checkpoints(run) == []
    with pytest.raises(FivefoldError, match="the held-out loss became nan at step 1: lower --lr"):
        train(tiny_run(corpus, steps=1, lr=1e308, warmup_steps=0), tmp_path / "eval", progress=False)


def test_the_default_run_directory_stays_under_runs_whatever_the_model_is_named() -> None:
    """The model's name is a file name there: "../x", "/x" or "org/model" cannot lead elsewhere."""
    from fivefold.commands.train import default_run_dir

    for name, start in (
        ("../../../evil", "evil-"),
        ("/abs/x", "abs-x-"),
        ("org/model", "org-model-"),
        ("..", "model-"),
    ):
        path = default_run_dir(name)
        assert path.parent == Path("runs") and path.name.startswith(start), (name, path)


def test_a_first_step_that_is_not_finite_points_at_the_initial_weights() -> None:
    """Step 1's loss and gradients come before any update: --lr cannot be what made them NaN."""
    from fivefold.train.loop import _diverged

    spec = TrainSpec(dtype="bf16")
    assert "initial weights" in _diverged("loss", math.nan, 1, spec) and "--lr" not in _diverged(
        "loss", math.nan, 1, spec
    )
    assert "lower --lr" in _diverged("gradient norm", math.inf, 2, spec)
    assert "lower --lr" in _diverged("held-out loss", math.nan, 1, spec)  # measured after step 1's update
