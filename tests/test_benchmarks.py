"""The benchmark scripts' own arithmetic and their behaviour where the peer or the GPU is missing."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_order_balanced_ratio_cancels_who_ran_first() -> None:
    order_balanced = _load("bench_vs_torchtitan").order_balanced
    rows = [
        {"first": "titan", "res": {"ratio": 1.10}},
        {"first": "titan", "res": {"ratio": 1.00}},
        {"first": "fivefold", "res": {"ratio": 0.90}},
    ]
    titan_side = math.sqrt(1.10 * 1.00)
    assert order_balanced(rows) == pytest.approx(math.sqrt(titan_side * 0.90))
    assert order_balanced(rows[:2]) is None  # one order only: nothing to cancel
    assert order_balanced([{"first": "titan", "res": {}}, {"first": "fivefold", "res": {}}]) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_the_gpu_benchmark_says_so_and_succeeds_without_a_gpu() -> None:
    done = subprocess.run([sys.executable, str(BENCH / "bench_gpu.py")], capture_output=True, text=True)
    assert done.returncode == 0
    assert "no CUDA GPU" in done.stdout


def test_plan_against_run_trains_plans_and_calibrates_here(tmp_path) -> None:
    """The script behind docs/planner.md's GPU calibration table, on this CPU with the tiny model."""
    keep = tmp_path / "runs"
    command = [sys.executable, str(BENCH / "bench_plan_vs_run.py"), "--device", "cpu", "--model", "tiny"]
    command += ["--dtype", "fp32", "--steps", "3", "--seq", "32", "--no-compile", "--keep-runs", str(keep)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| eager-")]
    assert len(rows) == 5 and "(fitted)" in rows[0]
    assert sorted(p.name for p in keep.iterdir()) == sorted(row.split()[1] for row in rows)


def test_the_gloo_link_benchmark_prints_a_latency_and_a_bandwidth_for_a_hardware_file() -> None:
    """The measurement behind the `cpu` preset's links, on small payloads so that it stays quick."""
    command = [sys.executable, str(BENCH / "bench_gloo_links.py"), "--large-mb", "0.5", "--repeats", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    values = dict(line.split("#")[0].split(" = ") for line in done.stdout.splitlines() if " = " in line)
    assert float(values["intra_node_latency_us"]) > 0 and float(values["intra_node_gbps"]) > 0
    assert float(values["tp_dispatch_us"]) >= 0 and float(values["fsdp_dispatch_us"]) >= 0
    assert float(values["cp_dispatch_us"]) >= 0
    assert 0 < float(values["block_dispatch_us"]) < 10_000  # a block's host work, microseconds


def test_the_gemm_shape_benchmark_fits_a_known_half_dimension_and_runs_here(tmp_path) -> None:
    """The fit behind bench_gemm_shapes.md recovers the half dimension of rates made from one, and the
    script measures small shapes on this CPU into its JSON."""
    fit_half_dim = _load("bench_gemm_shapes").fit_half_dim
    made = [(d, 700e12 * d / (d + 90)) for d in (128, 256, 512, 1024, 4096, 16384)]
    half, peak, err = fit_half_dim(made)
    assert abs(half - 90) / 90 < 0.08 and abs(peak - 700e12) / 700e12 < 0.08 and err < 0.01
    out = tmp_path / "gemm.json"
    command = [sys.executable, str(BENCH / "bench_gemm_shapes.py"), "--device", "cpu", "--tokens", "256"]
    command += ["--max-dim", "512", "--repeats", "2", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["gemm"]) >= 5 and all(row["flops"] > 0 for row in result["gemm"])
    assert [a["head_dim"] for a in result["attention"]] == [64, 128, 256]
    assert [(a["seq"], a["causal"]) for a in result["attention_by_sequence"]] == [(512, True), (512, False)]
    assert result["planner_fixed_keys"] == 0  # the cpu preset's attention is not tiled into query blocks


def test_the_fixed_keys_fit_recovers_the_cost_rates_were_made_with() -> None:
    fit_fixed_keys = _load("bench_gemm_shapes").fit_fixed_keys
    made = [(k, 400e12 * k / (k + 230)) for k in (256, 512, 1024, 2048, 4096, 8192)]
    keys, top = fit_fixed_keys(made)
    assert abs(keys - 230) < 1 and abs(top - 400e12) / 400e12 < 1e-6
