"""Checkpoints: exact resume, atomic saves, clear errors on corrupt or missing checkpoints."""

from __future__ import annotations

import shutil

import pytest
import torch

from fivefold.config import RunConfig, TrainSpec, load_model
from fivefold.errors import FivefoldError
from fivefold.train import checkpoint as ckpt
from fivefold.train import train
from fivefold.train.plots import read_metrics


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and never stall waiting for a busy core's sibling."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def config(corpus: str, model: str = "tiny", **train) -> RunConfig:
    base = dict(
        steps=6,
        seq_len=32,
        micro_batch=4,
        warmup_steps=2,
        eval_every=1000,
        eval_batches=1,
        checkpoint_every=3,
        data=corpus,
        device="cpu",
    )
    base.update(train)
    return RunConfig(model=load_model(model), train=TrainSpec(**base))


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_resume_continues_with_bitwise_the_same_losses(tmp_path, corpus, model):
    whole = train(config(corpus, model), tmp_path / "whole", progress=False)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "whole")] == [3, 6]
    # a second run directory that only has what the first had after step 3
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step_3", part / "checkpoints" / "step_3")
    resumed = train(config(corpus, model), part, resume="latest", progress=False)
    assert resumed.first_step == 4
    assert resumed.losses == whole.losses[3:]  # exact equality
    assert [r["step"] for r in read_metrics(part / "metrics.jsonl")] == [4, 5, 6]


def test_resume_in_place_rewrites_repeated_steps(tmp_path, corpus):
    run = tmp_path / "run"
    whole = train(config(corpus), run, progress=False)
    again = train(config(corpus), run, resume="3", progress=False)
    assert again.losses == whole.losses[3:]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_only_the_newest_checkpoints_are_kept(tmp_path, corpus):
    train(config(corpus, steps=8, checkpoint_every=2), tmp_path / "r", progress=False)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "r")] == [6, 8]


def test_an_interrupted_save_leaves_the_previous_checkpoint_intact(tmp_path, corpus, monkeypatch):
    run = tmp_path / "run"
    first = train(config(corpus, steps=3), run, progress=False)
    real_save = ckpt.dcp.save

    def crash_half_way(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # files written ...
        raise KeyboardInterrupt  # ... but killed before the rename

    monkeypatch.setattr(ckpt.dcp, "save", crash_half_way)
    with pytest.raises(KeyboardInterrupt):
        train(config(corpus, steps=6), run, resume="latest", progress=False)
    assert (run / "checkpoints" / "step_6.tmp").exists()  # the partial write stays out of the way
    assert ckpt.find_checkpoint(run) == run / "checkpoints" / "step_3"
    monkeypatch.setattr(ckpt.dcp, "save", real_save)
    resumed = train(config(corpus, steps=6), run, resume="latest", progress=False)
    assert resumed.first_step == 4 and len(resumed.losses) == 3
    assert not (run / "checkpoints" / "step_6.tmp").exists()
    assert first.losses == train(config(corpus, steps=3), tmp_path / "fresh", progress=False).losses


def test_corrupt_or_missing_checkpoints_are_clear_errors(tmp_path, corpus):
    run = tmp_path / "run"
    train(config(corpus, steps=3), run, progress=False)
    step = run / "checkpoints" / "step_3"
    for data_file in step.glob("*.distcp"):
        data_file.write_bytes(data_file.read_bytes()[:100])  # truncated on disk
    with pytest.raises(FivefoldError, match="corrupt or incomplete"):
        train(config(corpus, steps=6), run, resume="latest", progress=False)
    (step / ".metadata").unlink()
    with pytest.raises(FivefoldError, match="corrupt or incomplete"):
        train(config(corpus, steps=6), run, resume="latest", progress=False)
    with pytest.raises(FivefoldError, match="not found; available steps: 3"):
        ckpt.find_checkpoint(run, "5")
    with pytest.raises(FivefoldError, match="no checkpoint"):
        train(config(corpus), tmp_path / "empty", resume="latest", progress=False)


def test_a_finished_run_directory_is_not_overwritten(tmp_path, corpus):
    train(config(corpus, steps=3), tmp_path / "r", progress=False)
    with pytest.raises(FivefoldError, match="--resume"):
        train(config(corpus, steps=3), tmp_path / "r", progress=False)
