"""--compile: blocks compiled in place train to the eager run's losses; refused where it cannot run.

The compiled runs use the `aot_eager` backend (FIVEFOLD_COMPILE_BACKEND): the same graph capture,
autograd tracing and FSDP interplay as inductor without generating C++ kernels, which on a small
CPU would take minutes. Tolerance: losses within 1e-5 relative of eager (fp32; a traced graph may
reorder float operations).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from distributed import run_distributed
from fivefold.config import Layout, RunConfig, TrainSpec, load_model
from fivefold.errors import FivefoldError
from fivefold.parallel.compile import check_compile
from fivefold.train import train

LOSS_RTOL = 1e-5
STEPS = 3
SPEC = replace(load_model("tiny"), layers=1)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compile_is_refused_with_ep_and_cp() -> None:
    with pytest.raises(FivefoldError, match=r"--compile does not run with --ep 2: .*dp, fsdp, tp"):
        check_compile(Layout(dp=2, ep=2))
    with pytest.raises(FivefoldError, match=r"--compile does not run with --cp 2"):
        check_compile(Layout(cp=2))
    check_compile(Layout(dp=2, fsdp=2, tp=2, pp=2))  # the axes it runs with


def test_train_cli_refuses_compile_with_cp_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fivefold", "train", "--model", "tiny", "--nproc", "2", "--cp", "2"]
        + ["--compile", "--steps", "1", "--seq-len", "32", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--compile does not run with --cp 2" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_compiled_single_process_matches_eager(tmp_path, corpus, monkeypatch) -> None:
    monkeypatch.setenv("FIVEFOLD_COMPILE_BACKEND", "aot_eager")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = TrainSpec(steps=STEPS, seq_len=16, micro_batch=2, warmup_steps=1, eval_every=1000)
        base = replace(base, eval_batches=1, data=corpus, lr=3e-3, device="cpu")
        eager = train(RunConfig(model=SPEC, train=base), tmp_path / "eager", progress=False)
        before = _graphs()
        config = RunConfig(model=SPEC, train=replace(base, compile=True))
        compiled = train(config, tmp_path / "compiled", progress=False)
    finally:
        torch.set_num_threads(threads)
    assert _graphs() > before  # the block really went through torch.compile
    assert _rel(eager.losses, compiled.losses) <= LOSS_RTOL
    assert compiled.losses[-1] < compiled.losses[0]


def _fsdp_eager_and_compiled(rank: int, world: int) -> dict:
    import os
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["FIVEFOLD_COMPILE_BACKEND"] = "aot_eager"
    from fivefold.parallel.compare import run_layout
    from fivefold.parallel.device_mesh import build_runtime_mesh

    layout = Layout(fsdp=2).resolve(world)
    mesh = build_runtime_mesh(layout)
    out: dict = {}
    for compiled in (False, True):
        spec = TrainSpec(steps=STEPS, seq_len=16, micro_batch=2, global_batch=4, lr=3e-3, compile=compiled)
        before = _graphs()
        result, _, _ = run_layout(SPEC, spec, layout, 4, STEPS, mesh)
        out[compiled] = (result.losses, _graphs() - before)
    return out


def test_compiled_fsdp_matches_eager() -> None:
    for rank in run_distributed(_fsdp_eager_and_compiled, 2, timeout=180):
        (eager, eager_graphs), (compiled, graphs) = rank[False], rank[True]
        assert eager_graphs == 0 and graphs > 0
        assert _rel(eager, compiled) <= LOSS_RTOL
