"""Checkpoints: exact resume, atomic saves, clear errors on corrupt or missing checkpoints."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

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


def test_checkpoint_every_minus_one_saves_nothing(tmp_path, corpus):
    result = train(config(corpus, steps=2, checkpoint_every=-1), tmp_path / "r", progress=False)
    assert len(result.losses) == 2
    assert ckpt.list_checkpoints(tmp_path / "r") == []


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


def test_the_command_removes_the_save_it_did_not_finish(tmp_path, corpus, monkeypatch):
    """`fivefold train` (one process) interrupted while saving: the run ends with no step_N.tmp left,
    the finished checkpoints kept."""
    from fivefold.commands.train import start
    from fivefold.train.launch import TrainJob

    run = tmp_path / "run"
    train(config(corpus, steps=3), run, progress=False)
    real_save = ckpt.dcp.save

    def crash_half_way(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.dcp, "save", crash_half_way)
    with pytest.raises(KeyboardInterrupt):
        start(TrainJob(config(corpus, steps=6), run, resume="latest", progress=False), 1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3"]


@pytest.mark.parametrize("where", ["shards", "rng", "trainer.json"])
def test_a_full_disk_stops_the_run_with_one_line_and_frees_what_it_wrote(
    tmp_path, corpus, monkeypatch, where
):
    """No space for a checkpoint: the run stops (exit code 1, not 2: a fault, not bad input), the
    partial step_<N>.tmp is removed, and the earlier checkpoint resumes."""
    run = tmp_path / "run"
    train(config(corpus, steps=3), run, progress=False)
    full = OSError(errno.ENOSPC, "No space left on device")
    if where == "shards":  # DCP's own files
        monkeypatch.setattr(ckpt.dcp, "save", lambda state, checkpoint_id: (_ for _ in ()).throw(full))
    elif where == "rng":
        monkeypatch.setattr(ckpt.torch, "save", lambda *a, **k: (_ for _ in ()).throw(full))
    else:
        real_write = Path.write_text

        def no_room_for_trainer_json(self, *a, **k):
            if self.name == "trainer.json":
                raise full
            return real_write(self, *a, **k)

        monkeypatch.setattr(Path, "write_text", no_room_for_trainer_json)
    with pytest.raises(ckpt.CheckpointUnwritten) as caught:
        train(config(corpus, steps=6), run, resume="latest", progress=False)
    assert caught.value.exit_code == 1
    assert "step_6 could not be written" in str(caught.value) and "No space left" in str(caught.value)
    assert "earlier checkpoints are kept" in str(caught.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3"]
    monkeypatch.undo()
    resumed = train(config(corpus, steps=6), run, resume="latest", progress=False)
    assert resumed.first_step == 4


def test_a_full_disk_at_the_first_checkpoint_does_not_say_resume(tmp_path, corpus, monkeypatch):
    """With no earlier checkpoint there is nothing to resume: the line says to start again."""
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ckpt.dcp, "save", lambda state, checkpoint_id: (_ for _ in ()).throw(full))
    with pytest.raises(ckpt.CheckpointUnwritten) as caught:
        train(config(corpus, steps=2), tmp_path / "run", progress=False)
    assert "no checkpoint to resume from" in str(caught.value) and "kept" not in str(caught.value)
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []


def test_corrupt_or_missing_checkpoints_are_clear_errors(tmp_path, corpus):
    run = tmp_path / "run"
    train(config(corpus, steps=3), run, progress=False)
    step = run / "checkpoints" / "step_3"
    for data_file in step.glob("*.distcp"):
        data_file.write_bytes(data_file.read_bytes()[:100])  # truncated on disk
    with pytest.raises(FivefoldError, match="step_3 is incomplete .shard __0_0.distcp is 100 bytes"):
        train(config(corpus, steps=6), run, resume="latest", progress=False)
    # asked for by step or by path: the same check, refused before any rank reads it
    for which in ("3", str(step)):
        with pytest.raises(FivefoldError, match="step_3 is incomplete .shard __0_0.distcp is 100 bytes"):
            train(config(corpus, steps=6), run, resume=which, progress=False)
    (step / ".metadata").unlink()
    with pytest.raises(FivefoldError, match=r"\.metadata is missing"):
        train(config(corpus, steps=6), run, resume="latest", progress=False)
    with pytest.raises(FivefoldError, match="not found; available steps: 3"):
        ckpt.find_checkpoint(run, "5")
    with pytest.raises(FivefoldError, match="no finished checkpoint"):
        train(config(corpus), tmp_path / "empty", resume="latest", progress=False)


def test_a_trainer_record_of_another_step_is_not_a_whole_checkpoint(tmp_path, corpus, capsys):
    """step_4's trainer.json saying step 3 would make resume train step 4 again on step 4's weights."""
    run = tmp_path / "run"
    train(config(corpus, steps=4, checkpoint_every=1), run, progress=False)
    record = run / "checkpoints" / "step_4" / "trainer.json"
    record.write_text(record.read_text().replace('"step": 4', '"step": 3'))
    assert ckpt.checkpoint_problem(record.parent) == "trainer.json says step 3, its directory step_4"
    assert ckpt.find_checkpoint(run, "latest").name == "step_3"
    assert "falling back to step_3" in capsys.readouterr().err
    with pytest.raises(FivefoldError, match="step_4 is incomplete .trainer.json says step 3"):
        ckpt.find_checkpoint(run, "4")


def test_a_shard_damaged_in_place_is_refused_by_its_checksum(tmp_path, corpus):
    """Bytes overwritten inside a shard keep its size, so only the CRC-32 recorded at save time sees
    them: resume and generate refuse the checkpoint by name instead of loading garbage weights."""
    from fivefold.commands.generate import load_run

    run = tmp_path / "run"
    train(config(corpus, steps=3), run, progress=False)
    step = run / "checkpoints" / "step_3"
    assert set(json.loads((step / "checksums.json").read_text())) >= {"__0_0.distcp", ".metadata"}
    assert ckpt.damaged_file(step) is None
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit
    shard.write_bytes(bytes(data))
    assert ckpt.checkpoint_problem(step) is None  # sizes cannot see it
    assert ckpt.damaged_file(step) == "shard __0_0.distcp does not match the checksum it was written with"
    with pytest.raises(FivefoldError, match="step_3 is damaged: shard __0_0.distcp does not match"):
        train(config(corpus, steps=6), run, resume="latest", progress=False)
    with pytest.raises(FivefoldError, match="is damaged: .*generate from an earlier checkpoint"):
        load_run(run)
    # a crafted manifest reads nothing outside the checkpoint; one written before checksums has none
    (step / "checksums.json").write_text(json.dumps({"../../config.toml": 1}))
    assert "not a file of the checkpoint" in ckpt.damaged_file(step)
    (step / "checksums.json").unlink()
    assert ckpt.damaged_file(step) is None


def test_a_finished_run_directory_is_not_overwritten(tmp_path, corpus):
    train(config(corpus, steps=3), tmp_path / "r", progress=False)
    with pytest.raises(FivefoldError, match="--resume"):
        train(config(corpus, steps=3), tmp_path / "r", progress=False)


def test_resume_falls_back_past_an_incomplete_checkpoint_and_a_half_written_metrics_line(
    tmp_path, corpus, capsys
):
    whole = train(config(corpus, steps=4, checkpoint_every=1), tmp_path / "whole", progress=False)
    run = tmp_path / "run"
    train(config(corpus, steps=4, checkpoint_every=1), run, progress=False)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [3, 4]
    newest = run / "checkpoints" / "step_4"
    next(newest.glob("*.distcp")).unlink()  # a shard lost after the rename
    assert "is missing" in ckpt.checkpoint_problem(newest)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 5, "lo')  # killed while writing a line
    capsys.readouterr()
    resumed = train(config(corpus, steps=4), run, resume="latest", progress=False)
    err = capsys.readouterr().err
    assert "step_4 is incomplete" in err and "falling back to step_3" in err
    assert resumed.first_step == 4 and resumed.losses == whole.losses[3:]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert ckpt.checkpoint_problem(run / "checkpoints" / "step_4") is None  # saved again, whole


def test_storage_gone_read_only_before_a_save_stops_the_run_with_one_line(tmp_path, corpus, monkeypatch):
    """The checkpoint's own directory cannot be made (the file system went read-only): the same one
    line as any save the storage refused, exit code 1, the earlier checkpoint kept."""
    run = tmp_path / "run"
    train(config(corpus, steps=3), run, progress=False)
    real_mkdir = Path.mkdir

    def read_only(self, *a, **k):
        if self.name.endswith(".tmp"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ckpt.CheckpointUnwritten) as caught:
        train(config(corpus, steps=6), run, resume="latest", progress=False)
    assert caught.value.exit_code == 1 and "Read-only file system" in str(caught.value)
    assert "step_6 could not be written" in str(caught.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3"]


def test_a_file_under_a_checkpoints_unfinished_name_is_removed(tmp_path, corpus):
    """What a save or a deletion left, directory or not: a plain file under such a name (which
    rmtree cannot remove) would otherwise stay for good."""
    run = tmp_path / "run"
    train(config(corpus, steps=3), run, progress=False)
    root = run / "checkpoints"
    (root / "step_6.123.deleting").write_text("a retired file")
    (root / "step_7.tmp").write_text("a file by a save's name")
    (root / "step_8.tmp").mkdir()
    ckpt.remove_unfinished(run)
    assert sorted(p.name for p in root.iterdir()) == ["step_3"]


def test_a_run_directory_another_train_holds_is_refused_and_left_alone(tmp_path, corpus, capsys):
    """Two trainings into one run directory would interleave their metrics and checkpoints: while one
    runs (it holds the directory's lock), a resume or a new run there is refused with its pid, exit
    code 2, and the save it has in progress is not removed as a dead one."""
    import subprocess
    import sys

    from fivefold.cli import main
    from fivefold.train.loop import LOCK_FILE

    run = tmp_path / "run"
    train(config(corpus, steps=3), run, progress=False)
    in_progress = run / "checkpoints" / "step_6.tmp"
    in_progress.mkdir()
    holder = subprocess.Popen(  # a running train, as far as the lock says
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(run / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); os.write(fd, str(os.getpid()).encode())\n"
            "print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        flags = ["--data", corpus, "--seq-len", "32", "--no-progress"]
        for argv in (
            ["train", "--run-dir", str(run), "--resume", "--steps", "6", *flags],
            ["train", "--model", "tiny", "--run-dir", str(run), "--steps", "3", *flags],
            ["train", "--model", "tiny", "--run-dir", str(run / "new"), "--steps", "1", *flags],
        ):
            code = main(argv)
            err = capsys.readouterr().err
            if argv[-len(flags) - 1] == "1":  # another directory beside it: not held
                assert code == 0, err
                continue
            assert code == 2 and f"is in use by another fivefold train (pid {holder.pid})" in err, err
            assert len(err.strip().splitlines()) == 1 and in_progress.is_dir()
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "4", *flags]) == 0  # free again
    assert not in_progress.exists()  # the holder is gone: what it left is a dead save


def test_pruned_and_replaced_checkpoints_leave_the_step_names_before_they_are_deleted(
    tmp_path, corpus, monkeypatch
):
    run = tmp_path / "run"
    train(config(corpus, steps=2, checkpoint_every=1), run, progress=False)
    seen: list[str] = []

    def record_rmtree(path, ignore_errors=False):
        seen.append(Path(path).name)

    monkeypatch.setattr(ckpt.shutil, "rmtree", record_rmtree)  # deletions that never finish
    train(config(corpus, steps=3, checkpoint_every=1), run, resume="1", progress=False)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 3]
    assert all(name.endswith((".tmp", ".deleting")) for name in seen), seen
    retired = sorted({name.split(".")[0] for name in seen if name.endswith(".deleting")})
    assert retired == ["step_1", "step_2"]  # step 2 replaced by its repeat, step 1 pruned


@pytest.mark.slow
def test_resume_under_the_layout_flags_given_alone(tiny_run, tmp_path, capsys):
    """`--resume --tp 2` means "tp 2 now": the saved layout is not merged in, and the change is said."""
    import os
    import subprocess
    import sys

    from fivefold.cli import main

    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(tiny_run, one)
    shutil.copytree(tiny_run, two)
    saved = two / "config.toml"  # as a dp 2 run would have written it: the checkpoint is layout-free
    saved.write_text(saved.read_text().replace("\ndp = 1\n", "\ndp = 2\n"))
    assert main(["train", "--run-dir", str(one), "--resume", "--steps", "2", "--no-progress"]) == 0
    done = subprocess.run(
        [sys.executable, "-m", "fivefold", "train", "--run-dir", str(two), "--resume", "--steps", "2"]
        + ["--nproc", "2", "--tp", "2", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fivefold train: resuming under the layout given: dp 2 → 1, tp 1 → 2" in done.stderr
    assert "tp = 2" in (two / "config.toml").read_text()
    expected = read_metrics(one / "metrics.jsonl")[-1]
    got = read_metrics(two / "metrics.jsonl")[-1]
    assert got["step"] == expected["step"] == 2
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)


def test_resume_continues_on_the_ranks_the_run_was_trained_on(tiny_run, tmp_path, capsys, monkeypatch):
    """`--resume` without --nproc starts as many local ranks as the run's saved layout spans (said on
    stderr); an --nproc the saved layout does not divide is one line naming both ways on, before any
    rank starts."""
    import fivefold.commands.train as train_command
    from fivefold.cli import main

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    saved = run / "config.toml"  # as an fsdp 2 run would have written it: the checkpoint is layout-free
    text = saved.read_text().replace("\nfsdp = 1\n", "\nfsdp = 2\n").replace("\nzero = 0\n", "\nzero = 3\n")
    saved.write_text(text.replace("\nglobal_batch = 2\n", "\nglobal_batch = 8\n"))
    started = []
    monkeypatch.setattr(train_command, "start", lambda job, nproc: started.append(nproc) or 0)
    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "2", "--no-progress"]) == 0
    assert started == [2]
    assert "resuming on 2 local ranks, as the run was trained (--nproc to change)" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "2", "--nproc", "4"]) == 0
    assert started == [2, 4]  # dp fills the rest of a world the saved axes divide
    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "2", "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained with --fsdp 2 (2 ranks), and 2 does not divide 1" in err
    assert "resume with --nproc 2" in err and "--fsdp 1" in err and started == [2, 4]
    # a layout flag says the layout now: the ranks are what --nproc says (1 by default)
    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "2", "--fsdp", "1"]) == 0
    assert started == [2, 4, 1]
    # more data ranks keep the run's global batch: one that no longer splits names the way on
    saved.write_text(text.replace("\nglobal_batch = 2\n", "\nglobal_batch = 4\n"))
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--resume", "--steps", "2", "--nproc", "4"]) == 2
    err = capsys.readouterr().err
    assert "global batch of 4 sequences" in err and "micro-batches of 2 over 4 data-parallel ranks" in err
    assert "--micro-batch 1 keeps it, or resume with --nproc 2 as the run was trained" in err
    assert started == [2, 4, 1]
