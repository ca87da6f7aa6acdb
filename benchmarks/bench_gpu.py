"""MFU of a ~1B Llama trained on one GPU in bf16, eager and compiled, beside a peer on the same GPU.

fivefold runs through its real command (`fivefold train --device cuda --dtype bf16 [--compile]`,
the data loader and the per-step metrics included) and its own `metrics.jsonl` gives tokens/s and
MFU. The peer is HF transformers' LlamaForCausalLM of the same config (SDPA attention) in a plain
torch loop: the same bf16 autocast over fp32 master weights, torch's fused AdamW, the same loss, the
same tokens per step; compiled, each decoder layer goes through `torch.compile` as fivefold's blocks
do. Both are timed per step after a warm-up (compilation happens there) with the GPU synchronised;
the result is the ratio of medians (> 1: fivefold faster). The planner's prediction of the same run
(`fivefold plan` on the hardware preset that matches the GPU) is set beside the measurement.

MFU here is fivefold's: model FLOPs (6 × matmul weights + the full attention square) per token ×
tokens/s ÷ the preset's dense bf16 peak, the same formula for both sides.

Without a CUDA GPU it says so and exits 0 (`make bench` runs every benchmark).

Run: python benchmarks/bench_gpu.py [--steps 14] [--warmup 4] [--micro-batch 4] [--seq 2048]
     [--json OUT.json] [--md OUT.md] [--only fivefold|peer]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fivefold.config import ModelSpec
from fivefold.flops import model_flops_per_token

# The shape of Llama 3.2 1B (1.24 B parameters with tied embeddings).
MODEL = ModelSpec(
    name="llama-1b",
    layers=16,
    hidden=2048,
    heads=32,
    kv_heads=8,
    ffn_hidden=8192,
    vocab=128256,
    max_seq_len=8192,
    rope_theta=500000.0,
    tie_embeddings=True,
)


def model_toml(spec: ModelSpec, path: Path) -> Path:
    keys = ("name", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq_len")
    lines = [f"{k} = {json.dumps(getattr(spec, k))}" for k in keys]
    lines += [f"rope_theta = {spec.rope_theta}", f"tie_embeddings = {str(spec.tie_embeddings).lower()}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def train_command(
    model: str, run_dir: Path, device: str, dtype: str, steps: int, seq: int, micro: int, batch: int
) -> list[str]:
    """`fivefold train` for a benchmark: no checkpoint, the held-out loss only after the last step."""
    return [
        sys.executable, "-m", "fivefold", "train", "--model", model, "--device", device,
        "--dtype", dtype, "--steps", str(steps), "--warmup", "1", "--seq-len", str(seq),
        "--micro-batch", str(micro), "--global-batch", str(batch),
        "--eval-every", str(10 * steps), "--checkpoint-every", "-1",
        "--run-dir", str(run_dir), "--no-progress",
    ]  # fmt: skip


def fivefold_run(toml: Path, args: argparse.Namespace, compiled: bool, workdir: Path) -> dict[str, Any]:
    run_dir = workdir / ("fivefold-compiled" if compiled else "fivefold-eager")
    command = train_command(
        str(toml), run_dir, "cuda", "bf16", args.steps, args.seq, args.micro_batch, args.micro_batch
    )
    if compiled:
        command.append("--compile")
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr or done.stdout)[-2000:]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > args.warmup]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed),
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "first_step_s": records[0]["step_time_s"],
        "peak_memory_gb": max(r["memory"].get("device_peak", 0) for r in records) / 1e9,
        "loss_first_last": (records[0]["loss"], records[-1]["loss"]),
        "wall_s": time.perf_counter() - start,
    }


def peer_run(spec: ModelSpec, args: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    """HF LlamaForCausalLM in a plain torch loop: autocast bf16, fp32 masters, fused AdamW."""
    import transformers

    from fivefold.model import lm_loss
    from fivefold.model.hf import hf_config

    torch.manual_seed(0)
    fields = {k: v for k, v in hf_config(spec).items() if k != "architectures"}
    config = transformers.LlamaConfig(**fields, attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(config).cuda().train()
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(0)
    shape = (args.micro_batch, args.seq)
    times, losses = [], []
    start = time.perf_counter()
    for _ in range(args.steps):
        inputs = torch.randint(0, 256, shape, generator=gen).cuda(non_blocking=True)
        labels = torch.randint(0, 256, shape, generator=gen).cuda(non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=inputs).logits
        loss = lm_loss(logits, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[args.warmup :])
    tokens_per_s = args.micro_batch * args.seq / step
    peak = hardware_peak()
    result = {
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * model_flops_per_token(spec, args.seq) / peak,
        "step_s": step,
        "first_step_s": times[0],
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
        "loss_first_last": (losses[0], losses[-1]),
        "wall_s": time.perf_counter() - start,
    }
    del model, optimizer
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def hardware_preset() -> str:
    from fivefold.train.metrics import hardware_preset_for

    return hardware_preset_for(torch.device("cuda", 0))


def hardware_peak() -> float:
    from fivefold.config import load_hardware

    return load_hardware(hardware_preset()).peak_tflops * 1e12


def planned(toml: Path, args: argparse.Namespace, compiled: bool = False) -> dict[str, Any]:
    """The planner's step time, MFU and memory for the same model, batch and single GPU: of the
    eager runtime, or with `compiled` of `train --compile` (`plan --compile`)."""
    command = [
        sys.executable, "-m", "fivefold", "plan", "--model", str(toml), "--hardware", hardware_preset(),
        "--gpus", "1", "--seq-len", str(args.seq), "--global-batch", str(args.micro_batch),
        "--micro-batch", str(args.micro_batch), "--recompute", "none", "--json",
    ] + (["--compile"] if compiled else [])  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    plan = json.loads(done.stdout)
    return {
        "step_s": plan["step_time_s"],
        "mfu": plan["mfu"],
        "mfu_low": plan.get("mfu_low"),
        "mfu_high": plan.get("mfu_high"),
        "memory_gb": plan["memory"]["total"] / 1e9,
        "fits": plan["fits"],
    }


def sdpa_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """Which kernels torch's SDPA runs for the model's causal training call (forward and backward, the
    benchmark's batch and heads), and the call's rate by default and on the backends the planner tells
    apart: FlashAttention-2 class (FLASH_ATTENTION) and cuDNN's fused attention (`--attention flash3`).
    Counted as the published kernels count: 4·s²·d a head forward, halved when causal, backward 2.5×."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    head_dim = MODEL.hidden // MODEL.heads
    q, k, v = (
        torch.randn(
            args.micro_batch, MODEL.heads, args.seq, head_dim, device="cuda", dtype=torch.bfloat16
        ).requires_grad_()
        for _ in range(3)
    )

    def call() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def rate() -> float:
        for _ in range(3):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            call()
        end.record()
        torch.cuda.synchronize()
        flops = 3.5 * 4 * args.micro_batch * MODEL.heads * args.seq**2 * head_dim / 2
        return flops / (start.elapsed_time(end) / 20 / 1e3) / 1e12

    out: dict[str, Any] = {"head_dim": head_dim, "default_tflops": rate()}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    out["default_kernel"] = (
        "cudnn"
        if any("cudnn" in n and "sdpa" in n for n in names)
        else ("flash" if any("flash" in n for n in names) else "other")
    )
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                out[f"{backend.lower()}_tflops"] = rate()
        except RuntimeError as exc:  # a backend this build or GPU lacks
            out[f"{backend.lower()}_tflops"] = f"unavailable: {str(exc).splitlines()[0][:80]}"
    return out


def table(result: dict[str, Any]) -> str:
    rows = [
        "| | tokens/s | MFU | step (s) | first step (s) | peak memory (GB) |",
        "|---|---|---|---|---|---|",
    ]
    for label, key in (
        ("fivefold eager", "fivefold_eager"),
        ("peer eager", "peer_eager"),
        ("fivefold --compile", "fivefold_compiled"),
        ("peer compiled", "peer_compiled"),
    ):
        r = result.get(key)
        if not r:
            continue
        if "error" in r:
            rows.append(f"| {label} | failed: {r['error'].strip().splitlines()[-1][:120]} | | | | |")
            continue
        rows.append(
            f"| {label} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f} % | {r['step_s']:.3f} | "
            f"{r['first_step_s']:.1f} | {r['peak_memory_gb']:.1f} |"
        )
    for key, label in (("plan", "plan"), ("plan_compiled", "plan --compile")):
        each = result.get(key, {})
        if "step_s" in each:
            rows.append(
                f"| {label} ({result['hardware']}) | {args_tokens(result) / each['step_s']:,.0f} | "
                f"{100 * each['mfu']:.1f} % ({100 * each['mfu_low']:.1f}–{100 * each['mfu_high']:.1f}) | "
                f"{each['step_s']:.3f} | | {each['memory_gb']:.1f} (planned) |"
            )
    plan = result.get("plan", {})
    lines = ["\n".join(rows), ""]
    for mode in ("eager", "compiled"):
        ours, theirs = result.get(f"fivefold_{mode}", {}), result.get(f"peer_{mode}", {})
        if "tokens_per_s" in ours and "tokens_per_s" in theirs:
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
            lines.append(f"- fivefold ÷ peer tokens/s, {mode}: **{ratio:.3f}**")
    sdpa = result.get("sdpa", {})
    if "default_kernel" in sdpa:
        rates = ", ".join(
            f"{name} {sdpa[key]:.0f}" if isinstance(sdpa[key], float) else f"{name} {sdpa[key]}"
            for name, key in (
                ("default", "default_tflops"),
                ("FlashAttention-2 backend", "flash_attention_tflops"),
                ("cuDNN backend", "cudnn_attention_tflops"),
            )
        )
        lines.append(
            f"- SDPA's causal call (head dim {sdpa['head_dim']}) runs {sdpa['default_kernel']} kernels by "
            f"default; TFLOP/s: {rates}"
        )
    ours = result.get("fivefold_eager", {})
    if "step_s" in ours and "step_s" in plan:
        lines.append(f"- planned ÷ measured step time, fivefold eager: {plan['step_s'] / ours['step_s']:.3f}")
    return "\n".join(lines)


def args_tokens(result: dict[str, Any]) -> int:
    return result["micro_batch"] * result["seq"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--only", choices=("fivefold", "peer"), help="run one side only")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--keep-runs", help="copy fivefold's run directories here (for `plan --calibrate`)")
    parser.add_argument("--md", help="append the table to this Markdown file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here; nothing to measure")
        return 0
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "hardware": hardware_preset(),
        "model": MODEL.name,
        "params": MODEL.num_params(),
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "load_at_start": os.getloadavg(),
    }
    modes = ["eager"] + ([] if args.no_compile else ["compiled"])
    with tempfile.TemporaryDirectory() as tmp:
        toml = model_toml(MODEL, Path(tmp) / "llama-1b.toml")
        result["plan"] = planned(toml, args)
        result["plan_compiled"] = planned(toml, args, compiled=True)
        result["sdpa"] = sdpa_kernels(args)
        print(f"sdpa: {result['sdpa']}", flush=True)
        for mode in modes:
            if args.only != "peer":
                result[f"fivefold_{mode}"] = fivefold_run(toml, args, mode == "compiled", Path(tmp))
                if args.keep_runs:
                    shutil.copytree(Path(tmp), args.keep_runs, dirs_exist_ok=True)
                print(f"fivefold {mode}: {result[f'fivefold_{mode}']}", flush=True)
            if args.only != "fivefold":
                try:
                    result[f"peer_{mode}"] = peer_run(MODEL, args, mode == "compiled")
                except Exception as exc:  # the peer failing must not lose fivefold's rows
                    result[f"peer_{mode}"] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"peer {mode}: {result[f'peer_{mode}']}", flush=True)
    text = (
        f"{result['gpu']}, torch {result['torch']}, {MODEL.name} "
        f"({result['params'] / 1e9:.2f} B parameters), "
        f"bf16, micro-batch {args.micro_batch} × {args.seq} tokens, median of steps "
        f"{args.warmup + 1}–{args.steps}\n\n" + table(result)
    )
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.md:
        with open(args.md, "a") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
