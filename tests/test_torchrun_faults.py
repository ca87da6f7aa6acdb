"""Under torchrun with two agents (two "nodes" on this machine), losing the agent that does not host
the rendezvous store ends the whole run non-zero within a bounded time: its workers do not train on
as orphans, and the surviving agent does not report success.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torch.distributed.run") is None, reason="torchrun is not installed"
    ),
]

BOUND = 5 + 20  # seconds from the agent's death to the end of the run, on a loaded machine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers through /proc")
@pytest.mark.parametrize(("backend", "per_node"), [("c10d", 2), ("static", 1)])
def test_killing_the_agent_without_the_store_ends_the_run_non_zero(tmp_path, corpus, backend, per_node):
    run, port = tmp_path / "run", _free_port()
    train = ["-m", "fivefold.train", "--model", "tiny", "--steps", "100000", "--seq-len", "16"]
    train += ["--micro-batch", "2", "--device", "cpu", "--no-progress", "--data", corpus]
    train += ["--eval-every", "100000", "--run-dir", str(run)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")

    def agent(node: int) -> subprocess.Popen:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        argv += ["--nproc-per-node", str(per_node), "--max-restarts", "0", "--local-addr", "127.0.0.1"]
        if backend == "c10d":  # node 0 hosts the store
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "faults"]
            argv += ["--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}"]
        else:
            argv += ["--rdzv-backend", "static", "--node-rank", str(node)]
            argv += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        log = open(tmp_path / f"agent{node}.log", "w")  # noqa: SIM115 - the child writes it
        return subprocess.Popen(
            argv + train, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    host = agent(0)
    other = agent(1)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size):
            if host.poll() is not None or other.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run did not start: {(tmp_path / 'agent0.log').read_text()[-2000:]}")
            time.sleep(0.2)
        workers = _children(other.pid)
        assert len(workers) == per_node, workers
        os.kill(other.pid, signal.SIGKILL)  # the agent only: its workers are left to notice
        other.wait(timeout=30)
        t0 = time.monotonic()
        host.wait(timeout=BOUND + 30)
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        orphans = [w for w in workers if _alive(w)]
    finally:
        for proc in (host, other):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        for pid in workers:  # their own session: what the test started must not outlive it
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    host_log = (tmp_path / "agent0.log").read_text()
    other_log = (tmp_path / "agent1.log").read_text()
    assert orphans == [], "the killed agent's workers trained on as orphans"
    assert host.returncode not in (0, None), host_log[-3000:]
    assert elapsed < BOUND, elapsed
    assert "its launcher" in other_log and "is gone" in other_log, other_log[-2000:]
    assert "lost a peer rank" in host_log, host_log[-3000:]


def _failure(exitcode: int, message: object, timestamp: int):
    from types import SimpleNamespace

    return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp)


LOST = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4242"


@pytest.mark.parametrize(
    ("failures", "words"),
    [
        # rank 1 killed; rank 0 then lost it in a collective: the killed rank is the cause
        ({0: _failure(1, {"message": LOST}, 10), 1: _failure(-9, "", 11)}, "rank 1 killed by SIGKILL"),
        # rank 1 raised; rank 0 lost it after: not the first-numbered rank, the one that did not lose a peer
        (
            {0: _failure(1, {"message": LOST}, 10), 1: _failure(1, {"message": "ValueError: bad\n"}, 10)},
            "rank 1 failed: ValueError: bad",
        ),
        # two ranks failing on their own: the earlier report
        (
            {0: _failure(1, "OSError: late", 12), 1: _failure(1, "OSError: early", 11)},
            "rank 1 failed: OSError: early",
        ),
        ({3: _failure(1, "", 5)}, "rank 3 exited with code 1"),
    ],
)
def test_a_lost_rank_of_verify_or_generate_is_named_in_one_line(failures, words) -> None:
    """verify and generate start their ranks through `spawn_ranks`: of the ranks that failed it names
    the one that went first (killed, or failing without having lost a peer), in one line with exit
    code 1 (a fault, not bad input), where it had raised the launcher's traceback."""
    from fivefold.parallel.spawn import RankFailed, the_cause

    error = RankFailed(*the_cause(failures))
    assert str(error).startswith(words) and error.exit_code == 1 and len(str(error).splitlines()) == 1
