"""How fast a matmul runs as its smallest dimension shrinks: the planner's GEMM shape curve, measured.

The planner times each matmul at `matmul_efficiency · d / (d + gemm_half_dim)` of the peak, d the
matmul's smallest dimension (plan/compute.py), and each attention kernel at
`head_dim / (head_dim + ATTENTION_HALF_DIM)` of its rate at head dim 128. This script measures both
curves on the device at hand: 16-bit (m×k)·(k×n) matmuls with m fixed at a step's token count and k,
n swept from thin to wide (and thin token counts against wide weights), and torch's fused attention
(scaled_dot_product_attention, causal) over head dims 64, 128 and 256. It then fits the half
dimension that describes the measured matmuls best (free peak, least mean |log error|) and prints it
beside the planner's for that device (every GPU preset's 128, the `cpu` preset's 0), with each
shape's measured and predicted rate relative to the widest.

Last, attention's fixed cost per query block: fused attention forward and backward at head dim 128
over sequences from 512 tokens up (the same tokens a call, causal and not), fitted to
rate = long-sequence rate · k/(k + fixed keys), k the keys a query visits (s/2 causal, s not). The
planner's `attention_fixed_keys` (256 on every GPU preset, 0 on `cpu`) is printed beside the fit.

`--backends` measures only what the planner's `flash` and `flash3` kernels stand for on this GPU:
SDPA's FlashAttention-2 backend and cuDNN's fused attention, forward and backward, causal, head dim 128,
from 1k to 64k tokens a sequence (64k tokens a call), their ratio beside the planner's FLASH3_SPEEDUP.

Run: python benchmarks/bench_gemm_shapes.py [--device cuda|cpu] [--tokens 8192] [--max-dim 16384]
     [--repeats 20] [--json OUT.json] [--backends]
Without a CUDA GPU and without `--device cpu` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch

from fivefold.config import load_hardware
from fivefold.plan.compute import ATTENTION_HALF_DIM, FLASH3_SPEEDUP, head_dim_factor


def timed(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median seconds of one call of `fn`. Each sample runs enough calls back to back to fill about
    2 ms, so that a small matmul's launch and the host's synchronisation do not pass for its time."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    calls = min(1000, max(1, math.ceil(2e-3 / max(time.perf_counter() - start, 1e-7))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, device: str, repeats: int) -> float:
    """Measured FLOP/s of one (m×k)·(k×n) matmul."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    return 2.0 * m * k * n / timed(lambda: a @ b, repeats, device)


def attention_rate(
    head_dim: int,
    heads: int,
    seq: int,
    tokens: int,
    dtype: torch.dtype,
    device: str,
    repeats: int,
    causal: bool = True,
    backward: bool = False,
) -> float:
    """Measured FLOP/s of fused attention over `tokens` in sequences of `seq`, counted as the published
    kernel benchmarks count them: 4·s²·d per head forward (halved by a causal mask) and, with
    `backward`, 2.5 times that more."""
    batch = max(1, tokens // seq)
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=backward)
        for _ in range(3)
    )
    grad = torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device) if backward else None
    flops = (3.5 if backward else 1.0) * 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)

    def call() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if backward:
            torch.autograd.grad(out, (q, k, v), grad)

    return flops / timed(call, repeats, device)


def backend_rates(repeats: int) -> list[dict[str, float]]:
    """FLOP/s of SDPA's FlashAttention-2 backend and of cuDNN's, per sequence length (`--backends`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for seq in (1024, 4096, 16384, 65536):
        row: dict[str, float] = {"seq": seq}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    row[name] = attention_rate(
                        128, 16, seq, 65536, torch.bfloat16, "cuda", repeats, backward=True
                    )
            except RuntimeError:  # a backend this build or GPU lacks
                row[name] = float("nan")
        rows.append(row)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: SDPA backends, causal, head dim 128\n"
    )
    print(f"| sequence | FlashAttention-2 TFLOP/s | cuDNN TFLOP/s | ratio (planner {FLASH3_SPEEDUP}) |")
    print("|---|---|---|---|")
    for r in rows:
        flash, cudnn = r["flash"] / 1e12, r["cudnn"] / 1e12
        print(f"| {r['seq']} | {flash:.1f} | {cudnn:.1f} | {cudnn / flash:.2f} |")
    return rows


def fit_fixed_keys(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed keys, long-sequence FLOP/s) of rate = top·k/(k + fixed) that fits (keys k, rate) best.
    The time per score is then linear in 1/k: 1/rate = (1 + fixed/k)/top, a least-squares line."""
    xs = [1.0 / keys for keys, _ in points]
    ys = [1.0 / rate for _, rate in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    return slope / intercept, 1.0 / intercept


def shapes(tokens: int, max_dim: int) -> list[tuple[int, int, int]]:
    """Thin-to-wide weights at a step's token count, then thin token counts against wide weights."""
    dims = [2**p for p in range(7, int(math.log2(max_dim)) + 1)]
    out = [(tokens, d, d) for d in dims]  # square weights, as h×h projections
    out += [(tokens, max_dim, d) for d in dims[:-1]]  # a wide input into a narrow output (tp shards)
    out += [(d, max_dim, max_dim) for d in dims if d < tokens]  # few tokens (small micro-batches)
    return out


def fit_half_dim(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """(half dim, peak FLOP/s, mean |log error|) of rate = peak·d/(d+half) that fits best."""
    best = (0.0, 0.0, math.inf)
    for step in range(0, 121):
        half = 2 ** (step / 10)  # 1 .. 4096, 10 steps an octave
        logs = [math.log(rate * (d + half) / d) for d, rate in points]
        peak = math.exp(statistics.median(logs))
        err = statistics.fmean(abs(math.log(rate / (peak * d / (d + half)))) for d, rate in points)
        if err < best[2]:
            best = (half, peak, err)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--max-dim", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--backends", action="store_true", help="only SDPA's FlashAttention-2 and cuDNN backends"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gemm_shapes: no CUDA GPU here; nothing to measure (--device cpu runs it here)")
        return 0
    if args.backends:
        if args.device != "cuda":
            print("bench_gemm_shapes: --backends compares CUDA kernels; give --device cuda on a GPU")
            return 0
        rows = backend_rates(args.repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "backends": rows}, f, indent=1)
        return 0
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    # the curve the planner uses for this device: every GPU preset's, or the `cpu` preset's
    planner_half = round(load_hardware("h100-80gb" if args.device == "cuda" else "cpu").gemm_half_dim)
    rows = []
    for m, k, n in shapes(args.tokens, args.max_dim):
        rows.append({"m": m, "k": k, "n": n, "flops": gemm_rate(m, k, n, dtype, args.device, args.repeats)})
    widest = max(row["flops"] for row in rows)
    half, peak, err = fit_half_dim([(min(r["m"], r["k"], r["n"]), r["flops"]) for r in rows])
    shipped_peak = math.exp(
        statistics.median(
            math.log(r["flops"] * (min(r["m"], r["k"], r["n"]) + planner_half) / min(r["m"], r["k"], r["n"]))
            for r in rows
        )
    )
    print(f"# {name}, {str(dtype).removeprefix('torch.')} matmuls (rate relative to the fastest shape)\n")
    print(
        f"| m | k | n | TFLOP/s | measured | planner (half dim {planner_half}) "
        f"| fitted (half dim {half:.0f}) |"
    )
    print("|---|---|---|---|---|---|---|")
    shipped_errs = []
    for r in rows:
        d = min(r["m"], r["k"], r["n"])
        shipped = shipped_peak * d / (d + planner_half)
        fitted = peak * d / (d + half)
        shipped_errs.append(abs(math.log(r["flops"] / shipped)))
        print(
            f"| {r['m']} | {r['k']} | {r['n']} | {r['flops'] / 1e12:.1f} | {r['flops'] / widest:.2f} "
            f"| {shipped / widest:.2f} | {fitted / widest:.2f} |"
        )
    print(
        f"\nfitted half dimension: {half:.0f} (mean |log error| {err:.3f}); "
        f"the planner's {planner_half}: {statistics.fmean(shipped_errs):.3f}"
    )
    attention = []
    for head_dim in (64, 128, 256):
        heads, seq = max(1, 2048 // head_dim), min(4096, args.tokens)  # 2,048 wide, up to 4,096 tokens
        rate = attention_rate(head_dim, heads, seq, args.tokens, dtype, args.device, args.repeats)
        attention.append({"head_dim": head_dim, "flops": rate})
    ref = next(a["flops"] for a in attention if a["head_dim"] == 128)
    print(f"\n| head dim | attention TFLOP/s | ÷ head dim 128 | planner (half dim {ATTENTION_HALF_DIM}) |")
    print("|---|---|---|---|")
    for a in attention:
        print(
            f"| {a['head_dim']} | {a['flops'] / 1e12:.1f} | {a['flops'] / ref:.2f} "
            f"| {head_dim_factor(a['head_dim']):.2f} |"
        )
    fixed_keys = load_hardware("h100-80gb" if args.device == "cuda" else "cpu").attention_fixed_keys
    # 512 to 16k tokens on a GPU (each call the same tokens), up to --tokens on the CPU
    sweep_tokens = max(args.tokens, 16384) if args.device == "cuda" else max(args.tokens, 512)
    seqs = [2**p for p in range(9, 15) if 2**p <= sweep_tokens]
    sweep = []
    for causal in (True, False):
        for seq in seqs:
            rate = attention_rate(
                128, 16, seq, sweep_tokens, dtype, args.device, args.repeats, causal=causal, backward=True
            )
            sweep.append({"seq": seq, "causal": causal, "keys": seq // 2 if causal else seq, "flops": rate})
    fitted_keys, top = fit_fixed_keys([(a["keys"], a["flops"]) for a in sweep])
    print(
        "\n| sequence | causal | keys a query visits | forward+backward TFLOP/s "
        f"| ÷ fitted long-sequence rate | planner ({fixed_keys:.0f} fixed keys) |"
    )
    print("|---|---|---|---|---|---|")
    for a in sweep:
        planned = a["keys"] / (a["keys"] + fixed_keys)
        print(
            f"| {a['seq']} | {'yes' if a['causal'] else 'no'} | {a['keys']} | {a['flops'] / 1e12:.1f} "
            f"| {a['flops'] / top:.2f} | {planned:.2f} |"
        )
    print(
        f"\nfitted fixed keys: {fitted_keys:.0f} (long-sequence rate {top / 1e12:.1f} TFLOP/s); "
        f"the planner's: {fixed_keys:.0f}"
    )
    if args.json:
        result = {
            "device": name,
            "gemm": rows,
            "fitted_half_dim": half,
            "fit_error": err,
            "planner_half_dim": planner_half,
            "planner_error": statistics.fmean(shipped_errs),
            "attention": attention,
            "attention_by_sequence": sweep,
            "fitted_fixed_keys": fitted_keys,
            "planner_fixed_keys": fixed_keys,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
