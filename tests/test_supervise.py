"""Signals and stalls end a multi-rank run cleanly: one line, the right exit code, nothing left over.

Each case starts `fivefold train --nproc 2` on the tiny model with more steps than it will run,
waits for the first metrics line, then interrupts (Ctrl-C to the whole process group, or SIGTERM
to the launcher only) or stops one rank with SIGSTOP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fivefold.train.checkpoint import checkpoint_problem, list_checkpoints


def _launch(argv: list[str], stderr: int, **env: str) -> subprocess.Popen:
    """`fivefold ARGV` in its own process group, as a terminal would start it, its output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "fivefold", *argv],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )


def _start(tmp_path: Path, corpus: str, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    temp = tmp_path / "tmp"
    temp.mkdir()
    run = tmp_path / "run"
    argv = ["train", "--model", "tiny", "--nproc", "2", "--steps", "100000", "--seq-len", "16"]
    argv += ["--micro-batch", "2", "--device", "cpu", "--no-progress", "--data", corpus]
    argv += ["--eval-every", "100000", "--run-dir", str(run), *extra]
    proc = _launch(argv, subprocess.PIPE, TMPDIR=str(temp))
    deadline = time.monotonic() + 240
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size):
        if proc.poll() is not None or time.monotonic() > deadline:
            _end(proc)
            pytest.fail(f"the run did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    return proc, run, temp


def _end(proc: subprocess.Popen) -> None:
    """Leave nothing behind, whatever happened."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _own_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("rank ")]  # not the step log


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "code", "word"),
    [("ctrl-c", 130, "SIGINT"), ("sigterm", 143, "SIGTERM")],
)
def test_an_interrupt_stops_every_rank_at_a_step_boundary(tmp_path, corpus, how, code, word):
    flags = ["--checkpoint-on-interrupt"] if how == "ctrl-c" else []
    proc, run, temp = _start(tmp_path, corpus, *flags)
    try:
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # the launcher and every rank get it
        else:
            os.kill(proc.pid, signal.SIGTERM)  # the launcher only: it passes it on
        _, stderr = proc.communicate(timeout=120)
    finally:
        _end(proc)
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr
    lines = _own_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith(f"fivefold train: stopped: interrupted by {word}"), stderr
    assert not list(temp.glob("fivefold-*")), list(temp.iterdir())  # no rank or launcher folders left
    saved = list_checkpoints(run)
    if flags:
        step, path = saved[-1]
        assert f"after step {step}; checkpoint saved: {path}" in lines[0]
        assert checkpoint_problem(path) is None
    else:
        assert saved == []


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_the_watchdog_time(tmp_path, corpus):
    watchdog = 5
    proc, run, temp = _start(tmp_path, corpus, "--watchdog", str(watchdog))
    try:
        (ranks,) = temp.glob("fivefold-ranks-*")
        stopped = int((ranks / "rank1.pid").read_text())
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=watchdog + 60)
        elapsed = time.monotonic() - t0
    finally:
        _end(proc)
    assert proc.returncode not in (0, None), stderr[-3000:]
    assert elapsed < watchdog + 10, elapsed
    lines = _own_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("fivefold train: watchdog: rank 1 stopped responding"), lines[0]
    assert "last heard in" in lines[0] and "at step" in lines[0]  # its last beat, not the stop itself
    with pytest.raises(ProcessLookupError):  # killed, not left stopped
        os.kill(stopped, 0)
    assert not list(temp.glob("fivefold-ranks-*")), list(temp.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_rank_is_named_as_the_cause_not_its_peers_lost_connection(tmp_path, corpus, killed):
    proc, run, temp = _start(tmp_path, corpus, "--watchdog", "5")
    try:
        (ranks,) = temp.glob("fivefold-ranks-*")
        os.kill(int((ranks / f"rank{killed}.pid").read_text()), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=5 + 20)
    finally:
        _end(proc)
    assert proc.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    lines = _own_lines(stderr)
    assert lines == [
        f"fivefold train: rank {killed} was killed by SIGKILL; the other ranks stopped because they lost it"
    ], repr(stderr[-1500:])
    assert not list(temp.glob("fivefold-*")), list(temp.iterdir())  # no rank folder, no echoed traceback


@pytest.mark.slow
def test_the_ranks_of_a_killed_launcher_stop_and_remove_its_folder(tmp_path, corpus):
    proc, run, temp = _start(tmp_path, corpus, "--watchdog", "5")
    try:
        (ranks,) = temp.glob("fivefold-ranks-*")
        pids = [int((ranks / f"rank{r}.pid").read_text()) for r in range(2)]
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: nothing of it runs any more
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5 + 20
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        orphans = [pid for pid in pids if _running(pid)]
    finally:
        _end(proc)
        for pid in pids if "pids" in locals() else []:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert orphans == [], "the ranks trained on without their launcher"
    assert not list(temp.glob("fivefold-ranks-*")), "\n".join(_own_lines(proc.stderr.read()))[-3000:]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init, not by this test)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _failing_launch(failures, reports):
    """Stands in for torch's launcher: the ranks wrote `reports` ({rank: (code, message)}, with a
    traceback each) and torch saw `failures` ({rank: exit code})."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def launcher(config, entry):
        def run(job, error_dir):
            for rank, (code, message) in reports.items():
                trace = Path(error_dir) / f"rank{rank}.traceback"
                trace.write_text("Traceback (most recent call last): ...")
                (Path(error_dir) / f"rank{rank}.error").write_text(f"{code}\n{message} (traceback: {trace})")
            raise ChildFailedError(
                "fivefold",
                {
                    r: ProcessFailure(local_rank=r, pid=1, exitcode=c, error_file="<N/A>")
                    for r, c in failures.items()
                },
            )

        return run

    return launcher


@pytest.mark.parametrize(
    ("failures", "reports", "code", "line"),
    [
        (  # rank 0 died by a signal; rank 1's lost connection is the echo
            {0: -9},
            {1: (1, "RuntimeError: Connection reset by peer")},
            137,
            "fivefold train: rank 0 was killed by SIGKILL; the other ranks stopped because they lost it",
        ),
        (  # a real failure: named with a traceback that outlives the rank folder
            {1: 1},
            {1: (1, "ValueError: broken")},
            1,
            "fivefold train: rank 1 failed: ValueError: broken (traceback: ",
        ),
    ],
)
def test_the_launcher_names_the_cause_and_leaves_no_rank_folder(
    tmp_path, monkeypatch, capsys, failures, reports, code, line
):
    import tempfile

    import fivefold.train.launch as launch_module
    from fivefold.config import RunConfig, load_model

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(launch_module, "elastic_launch", _failing_launch(failures, reports))
    job = launch_module.TrainJob(RunConfig(model=load_model("tiny")), tmp_path / "run", watchdog=0)
    assert launch_module.launch(2, job) == code
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(line), err
    assert not list(tmp_path.glob("fivefold-ranks-*")) and not list(tmp_path.glob("fivefold-launch-*"))
    kept = list(tmp_path.glob("fivefold-rank*.traceback"))
    if code == 1:
        assert len(kept) == 1 and f"(traceback: {kept[0]})" in err and "Traceback" in kept[0].read_text()
    else:
        assert kept == []  # an echo's traceback is not kept


def test_a_stop_signal_repeated_at_once_counts_once(tmp_path):
    """A killed launcher's parent-death SIGINT reaches a rank once per launcher thread, within
    milliseconds: the rank still stops at its step boundary rather than dying without its cleanup."""
    from fivefold.train.supervise import rank_supervision, stop_requested, stopped_by_signal

    with rank_supervision(str(tmp_path), rank=0, heartbeat=False):
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs between bytecodes
        assert stop_requested() == signal.SIGINT and stopped_by_signal()
    assert tmp_path.exists()


@pytest.mark.slow
def test_a_reader_that_goes_away_does_not_end_the_run(tmp_path, corpus):
    """`fivefold train ... | head -1`: the ranks' progress lines then meet a closed pipe. The run goes
    on to its last step and its checkpoint, and exits 0 because it succeeded, not because it was cut."""
    run = tmp_path / "run"
    argv = [
        "train",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--steps",
        "30",
        "--seq-len",
        "16",
        "--micro-batch",
        "2",
    ]
    argv += [
        "--device",
        "cpu",
        "--no-progress",
        "--data",
        corpus,
        "--eval-every",
        "100000",
        "--run-dir",
        str(run),
    ]
    proc = _launch(argv, subprocess.STDOUT)
    try:
        first = proc.stdout.readline()  # the step-10 line: the pipe is closed before steps 20 and 30
        proc.stdout.close()
        assert proc.wait(timeout=240) == 0, first
    finally:
        _end(proc)
    steps = (run / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 30 and (run / "run.json").exists()
    assert list_checkpoints(run)[-1][0] == 30


def test_the_cause_is_reported_even_when_its_echo_was_written_first(tmp_path):
    """A rank that fails closes its connections while it unwinds, before it writes its report, so its
    peer's 'connection closed' can be on disk first (a full disk at start-up did this)."""
    from fivefold.train.launch import _first_failure

    echo = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:14256 (traceback: x)"
    (tmp_path / "rank1.error").write_text(f"1\n{echo}")
    time.sleep(0.01)
    (tmp_path / "rank0.error").write_text("1\nOSError: [Errno 28] No space left on device")
    assert _first_failure(tmp_path) == (0, 1, "OSError: [Errno 28] No space left on device")
    (tmp_path / "rank0.error").unlink()
    assert _first_failure(tmp_path) == (1, 1, echo)  # only echoes: the earliest


def test_a_phase_change_is_on_disk_at_once(tmp_path):
    """A rank stopped (SIGSTOP) between two beats is reported at the phase it had reached: the beat
    file carries every phase change as it happens, not only the thread's once-a-second write."""
    import json as _json
    import time

    from fivefold.train.supervise import Heartbeat

    beat = Heartbeat(tmp_path, 3)
    try:
        for step in range(1, 4):
            beat.mark(step, "saving a checkpoint")
            beat.mark(step, "agreeing whether to stop")
            deadline = time.monotonic() + 0.5  # the thread wakes for the change, far inside a beat
            record = {"step": None, "phase": None}
            while time.monotonic() < deadline:
                beat_file = tmp_path / "rank3.beat"  # replaced whole (a rename): absent or complete
                record = _json.loads(beat_file.read_text()) if beat_file.exists() else record
                if (record["step"], record["phase"]) == (step, "agreeing whether to stop"):
                    break
                time.sleep(0.005)
            assert (record["step"], record["phase"]) == (step, "agreeing whether to stop")
    finally:
        beat.close()
