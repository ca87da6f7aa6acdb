"""What only a CUDA GPU can show: the grouped expert kernel, the fused optimizer, and training on the
GPU (eager and compiled) against the CPU on the same weights and data. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from fivefold.config import Layout, RunConfig, TrainSpec, load_model
from fivefold.model import moe
from fivefold.parallel.data import optimizer_kernels
from fivefold.train.loop import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _experts(experts: int = 4, hidden: int = 64, ffn: int = 128, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    make = lambda *shape: (torch.randn(*shape, generator=gen) * 0.05).to("cuda", dtype).requires_grad_()  # noqa: E731
    return make(experts, ffn, hidden), make(experts, ffn, hidden), make(experts, hidden, ffn)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_kernel_matches_the_per_expert_loop_forward_and_backward():
    weights = _experts()
    counts = torch.tensor([5, 0, 19, 8], device="cuda")  # an expert with no tokens, uneven others
    x = (torch.randn(int(counts.sum()), 64, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    assert moe.grouped_mm_fits(x, weights[0])
    results = []
    for fn in (moe.swiglu_grouped_mm, moe.swiglu_per_expert):
        out = fn(x, counts, *weights)
        grads = torch.autograd.grad(out.float().square().sum(), (x, *weights))
        results.append((out.float(), [g.float() for g in grads]))
    (out_g, grads_g), (out_l, grads_l) = results
    torch.testing.assert_close(out_g, out_l, rtol=2e-2, atol=2e-3)
    for a, b in zip(grads_g, grads_l):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_autocast_over_fp32_experts_takes_the_grouped_kernel(monkeypatch):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    layer = moe.GroupedExperts(4, 64, 128).cuda()
    for w in layer.parameters():
        torch.nn.init.normal_(w, std=0.05)
    calls = []
    real = moe.swiglu_grouped_mm
    monkeypatch.setattr(moe, "swiglu_grouped_mm", lambda *a: calls.append(1) or real(*a))
    counts = torch.tensor([3, 9, 0, 4], device="cuda")
    x = torch.randn(16, 64, device="cuda")
    reference = moe.swiglu_per_expert(x, counts, layer.gate_proj, layer.up_proj, layer.down_proj)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x, counts)
    assert calls and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=3e-2, atol=3e-3)


def test_gpu_parameters_step_with_the_fused_adamw():
    params = [
        torch.nn.Parameter(torch.zeros(4, 4, device="cuda")),
        torch.nn.Parameter(torch.zeros(4, device="cuda")),
    ]
    assert optimizer_kernels(params) == {"fused": True, "foreach": False}


def _config(corpus: str, device: str, model: str = "tiny", **train_fields) -> RunConfig:
    fields = dict(
        steps=3, seq_len=32, micro_batch=4, warmup_steps=1, eval_every=1000, eval_batches=1,
        checkpoint_every=-1, data=corpus, device=device,
    )  # fmt: skip
    fields.update(train_fields)
    return RunConfig(model=load_model(model), train=TrainSpec(**fields), layout=Layout())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return str(path)


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_fp32_training_on_the_gpu_matches_the_cpu(tmp_path, corpus, model, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    cpu = train(_config(corpus, "cpu", model), tmp_path / "cpu", progress=False)
    gpu = train(_config(corpus, "cuda", model), tmp_path / "gpu", progress=False)
    torch.testing.assert_close(torch.tensor(gpu.losses), torch.tensor(cpu.losses), rtol=1e-4, atol=1e-5)


def test_bf16_and_compiled_training_on_the_gpu_follow_the_fp32_run(tmp_path, corpus):
    fp32 = train(_config(corpus, "cuda"), tmp_path / "fp32", progress=False)
    bf16 = train(_config(corpus, "cuda", dtype="bf16"), tmp_path / "bf16", progress=False)
    compiled = train(_config(corpus, "cuda", dtype="bf16", compile=True), tmp_path / "c", progress=False)
    torch.testing.assert_close(torch.tensor(bf16.losses), torch.tensor(fp32.losses), rtol=2e-2, atol=0)
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(bf16.losses), rtol=1e-2, atol=0)
