"""ZeRO-1's sharded optimizer through the training checkpoint: saving changes nothing, loading restores.

Three runners from the same seeded weights on 2 gloo ranks (dp 2, --zero 1): A trains 2 steps and
saves a checkpoint, B trains the same 2 steps without saving, C is fresh and loads A's checkpoint.
All three then take the same third step; their parameters and Adam moments must be equal exactly.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from distributed import run_distributed


def _save_resume(rank: int, world: int, directory: str) -> dict:
    warnings.filterwarnings("ignore")
    from fivefold.config import Layout, TrainSpec, load_model
    from fivefold.model import build_model
    from fivefold.parallel.compare import global_batch, rows_of
    from fivefold.parallel.device_mesh import build_runtime_mesh
    from fivefold.parallel.runners import build_runner
    from fivefold.train.checkpoint import checkpoints_root, load_checkpoint, save_checkpoint

    spec = load_model("tiny")
    layout = Layout(dp=2, zero=1).resolve(world)
    train = TrainSpec(seq_len=16, micro_batch=2, global_batch=4, lr=1e-3)
    mesh = build_runtime_mesh(layout)
    coord = mesh.coord("batch")

    def make():
        runner = build_runner(build_model(spec), mesh, layout, train)
        return runner, runner.build_optimizer(runner.model_parts[0])

    def step(runner, opt, index: int) -> None:
        x, y = global_batch(spec, train, 4, index)
        opt.zero_grad(set_to_none=True)
        runner.forward_backward(rows_of(x, coord, 2), rows_of(y, coord, 2))
        opt.step()
        opt.zero_grad(set_to_none=True)  # as the loop leaves it: no gradients at save time

    (a, opt_a), (b, opt_b), (c, opt_c) = make(), make(), make()
    for i in range(2):
        step(a, opt_a, i)
        step(b, opt_b, i)
    save_checkpoint(Path(directory), 2, a.model_parts, [opt_a], {"seed": 0})
    load_checkpoint(checkpoints_root(Path(directory)) / "step_2", c.model_parts, [opt_c])
    for runner, opt in ((a, opt_a), (b, opt_b), (c, opt_c)):
        step(runner, opt, 2)

    def snapshot(runner, opt) -> dict:
        params = dict(runner.model_parts[0].named_parameters())
        owned = opt.optim.state  # this rank's shard of the optimizer state
        moments = {n: owned[p]["exp_avg_sq"].clone() for n, p in params.items() if p in owned}
        return {"params": {n: p.detach().clone() for n, p in params.items()}, "moments": moments}

    return {"a": snapshot(a, opt_a), "b": snapshot(b, opt_b), "c": snapshot(c, opt_c)}


@pytest.mark.slow
def test_zero1_checkpoint_neither_perturbs_nor_loses_state() -> None:
    with tempfile.TemporaryDirectory() as directory:
        per_rank = run_distributed(_save_resume, 2, directory, timeout=300)
    for rank, got in enumerate(per_rank):
        assert got["b"]["moments"], "each rank owns the optimizer state of some parameters"
        for other in ("a", "c"):
            for kind in ("params", "moments"):
                for name, value in got["b"][kind].items():
                    assert torch.equal(got[other][kind][name], value), f"rank {rank} {other} {kind} {name}"


def _unshared_save(rank: int, world: int, directory: str) -> dict:
    """fsdp 2: step 1 saves whole; at step 2 rank 1's shard is where rank 0 cannot see it."""
    warnings.filterwarnings("ignore")
    from fivefold.config import Layout, TrainSpec, load_model
    from fivefold.errors import FivefoldError
    from fivefold.model import build_model
    from fivefold.parallel.device_mesh import build_runtime_mesh
    from fivefold.parallel.runners import build_runner
    from fivefold.train import checkpoint as ckpt
    from fivefold.train.loop import _check_shared

    # a run directory each rank has its own copy of (a path on a disk that is not shared)
    own = Path(directory) / f"node{rank}"
    own.mkdir()
    try:
        _check_shared(own, rank, world)
        start_error = None
    except FivefoldError as exc:
        start_error = str(exc)
    _check_shared(Path(directory), rank, world)  # and the shared one passes

    spec = load_model("tiny")
    layout = Layout(fsdp=2).resolve(world)
    mesh = build_runtime_mesh(layout)
    runner = build_runner(build_model(spec), mesh, layout, TrainSpec(seq_len=16, micro_batch=2))
    opt = torch.optim.AdamW(runner.model_parts[0].parameters())
    run = Path(directory)
    ckpt.save_checkpoint(run, 1, runner.model_parts, [opt], {"seed": 0})
    own_files = ckpt._own_files

    def written_elsewhere(tmp: Path, me: int) -> dict[str, int]:
        files = own_files(tmp, me)
        if me == 1:  # reported as written, then gone from the directory rank 0 reads
            for name in files:
                if name.endswith(".distcp"):
                    (tmp / name).unlink()
        return files

    ckpt._own_files = written_elsewhere
    try:
        ckpt.save_checkpoint(run, 2, runner.model_parts, [opt], {"seed": 0})
        error = None
    except FivefoldError as exc:
        error = str(exc)
    torch.distributed.barrier()
    return {
        "start_error": start_error,
        "error": error,
        "steps": [s for s, _ in ckpt.list_checkpoints(run)],
        "latest": ckpt.find_checkpoint(run).name,
    }


def test_unshared_run_directories_are_refused_and_a_shard_rank_0_cannot_see_stops_the_rename() -> None:
    with tempfile.TemporaryDirectory() as directory:
        per_rank = run_distributed(_unshared_save, 2, directory, timeout=300)
    for got in per_rank:  # every rank refuses to start, and fails the save, with the same one line
        assert "rank(s) 1 do not see the run directory" in got["start_error"]
        assert "rank 1's __1_0.distcp is not there" in got["error"]
        assert "storage every rank shares" in got["error"]
        assert got["steps"] == [1] and got["latest"] == "step_1"
