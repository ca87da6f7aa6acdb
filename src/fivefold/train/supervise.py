"""Ending a run cleanly: signals stop every rank at a step boundary; a watchdog ends a stalled run.

Signals. SIGINT or SIGTERM (to the launcher or to the ranks) does not kill a rank mid-step: the
rank notes it, finishes the step, and the ranks agree (a max-reduce of the flag) to stop after the
same step, optionally saving a checkpoint first. The launcher passes a signal on to its ranks (a
stop file they read at each step boundary) and leaves them to finish; a second signal kills them.
The run then ends with one line and exit code 128 + the signal (130 for SIGINT, 143 for SIGTERM).

Watchdog. Each rank has a thread that writes a heartbeat file every second: the step it is on,
what it is doing and when it last moved on. The launcher reads them; when a rank's heartbeat has
been silent for `--watchdog` seconds (stopped, or hung with the interpreter), or, once training
runs, no rank has moved on for that long (hung in a collective, or waiting for a rank that is), it
names the stuck rank (the silent one, else the ones furthest behind) and what it was doing, kills
every rank, and the run exits non-zero. torch's collective timeout (minutes) is only
the last resort.

Orphans. A rank whose launcher died (SIGKILL of a `fivefold train` launcher or of a torchrun agent)
would go on training for nobody, and keep its peers under the surviving launcher in step with it.
Each launched rank therefore watches its parent process and, once that is gone, says so in one line
and exits non-zero; its peers then fail on the lost connection instead of finishing as if all was
well.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fivefold.errors import FivefoldError
from fivefold.parallel.spawn import echoes_lost_peer

BEAT_SECONDS = 1.0
STOP_FILE = "stop"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Interrupted(FivefoldError):
    """A signal stopped the run at a step boundary: one line, exit code 128 + the signal."""

    label = "stopped"

    def __init__(self, signum: int, step: int, saved: Path | None = None) -> None:
        where = f"after step {step}" if step else "before the first step"
        kept = f"; checkpoint saved: {saved}" if saved is not None else ""
        super().__init__(f"interrupted by {signal_name(signum)} {where}{kept}")
        self.exit_code = 128 + signum


# --------------------------------------------------------------------------------------------
# in each rank


class Heartbeat:
    """This rank's step and phase, written to `<folder>/rank<R>.beat` by a thread every second, and as
    soon as the phase changes (the thread wakes for it; the file's write stays off the training
    thread): a rank stopped between two beats is reported where it stopped, not where the last beat
    found it."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = Path(folder) / f"rank{rank}.beat"
        self.step, self.phase, self.moved_at = 0, "starting", time.time()
        self._stop = threading.Event()
        self._moved = threading.Event()  # a phase changed since the last write
        self._thread = threading.Thread(target=self._run, name="fivefold-heartbeat", daemon=True)
        self._thread.start()

    def mark(self, step: int, phase: str) -> None:
        self.step, self.phase, self.moved_at = step, phase, time.time()
        self._moved.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._moved.clear()
            self._write()
            self._moved.wait(BEAT_SECONDS)

    def _write(self) -> None:
        record = {"step": self.step, "phase": self.phase, "moved_at": self.moved_at, "pid": os.getpid()}
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError:  # the launcher removed the folder: the run is over
            self._stop.set()

    def close(self) -> None:
        self._stop.set()
        self._moved.set()  # wake the thread to see it
        self._thread.join(timeout=2)


def launcher_gone(pid: int, wait_s: float = 0.0) -> bool:
    """The process `pid` that started this one has died: this one was handed to another parent,
    or `pid` is exiting (a killed process is a zombie while its last threads end, and torch's
    spawn already sent its children SIGINT by then). With `wait_s`, keep looking that long: the
    SIGINT comes when the launcher's spawning thread ends, which can be before the process shows
    as exiting."""
    deadline = time.monotonic() + wait_s
    while not _parent_gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _parent_gone(pid: int) -> bool:
    if os.getppid() != pid:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False  # no /proc: the change of parent alone tells


class ParentWatch:
    """A thread that ends this rank (exit code 1) when the process that started it is gone.

    Polling the parent works wherever the rank runs (an orphan is re-parented to init or a
    subreaper); with `folder`, the launcher's shared folder is removed on the way out."""

    POLL_SECONDS = 0.5
    EXIT_CODE = 1

    def __init__(self, rank: int, folder: str | None = None) -> None:
        self.rank, self.parent, self.folder = rank, os.getppid(), folder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fivefold-parent-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.POLL_SECONDS):
            if launcher_gone(self.parent):
                print(
                    f"fivefold train: rank {self.rank}: its launcher (pid {self.parent}) is gone; "
                    "this rank stops so that its peers do not train on without it",
                    file=sys.stderr,
                    flush=True,
                )
                if self.folder is not None:  # the launcher's folder: nobody else is left to remove it
                    shutil.rmtree(self.folder, ignore_errors=True)
                    # this rank's main thread may be writing its report into it right now (its
                    # collective failed with the lost peer): a file created after the listing
                    # keeps the folder, so remove again once that write has had its moment
                    time.sleep(self.POLL_SECONDS)
                    shutil.rmtree(self.folder, ignore_errors=True)
                os._exit(self.EXIT_CODE)  # the main thread may be inside a collective: no unwinding

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def lost_peer(exc: BaseException) -> bool:
    """`exc` is a collective failing because another rank's process is gone."""
    return isinstance(exc, RuntimeError) and echoes_lost_peer(str(exc))


def launched() -> bool:
    """This process is a rank that a launcher (torchrun's agent or `--nproc`) started."""
    return "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


_heartbeat: Heartbeat | None = None
_stop_signal: list[int] = []
# a stop signal repeated within this long counts once (see rank_supervision)
REPEAT_WINDOW_SECONDS = 1.0


def mark(step: int, phase: str) -> None:
    """Record progress: this rank is now doing `phase` of `step` (a no-op without a heartbeat)."""
    if _heartbeat is not None:
        _heartbeat.mark(step, phase)


_stop_file: list[Path] = []


def stopped_by_signal() -> bool:
    """A stop signal reached this rank itself (not only its launcher's stop file)."""
    return bool(_stop_signal)


def stop_requested() -> int:
    """The signal that asked this rank (or its launcher) to stop, or 0."""
    if _stop_signal:
        return _stop_signal[0]
    for path in _stop_file:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text())
    return 0


@contextlib.contextmanager
def rank_supervision(folder: str | None, rank: int, heartbeat: bool = True) -> Iterator[None]:
    """Inside a rank: stop-at-a-step-boundary signals, the launcher's stop file in `folder` (its
    forwarded signal) and, with `heartbeat`, the heartbeat its watchdog reads there. A launched rank
    also stops when its launcher dies (`ParentWatch`)."""
    global _heartbeat
    _stop_signal.clear()
    _stop_file[:] = [Path(folder) / STOP_FILE] if folder is not None else []
    previous: dict[int, Any] = {}

    first_at: list[float] = []
    launcher = os.getppid()

    def note(signum: int, frame: Any) -> None:
        now = time.monotonic()
        # torch's spawn sends its parent-death SIGINT once for every thread of a killed launcher
        # that the rank passes through on its way to a new parent: repeats within a moment are
        # that one event, not a second request
        if _stop_signal and now - first_at[0] > REPEAT_WINDOW_SECONDS:  # asked twice: stop now
            if folder is not None and launched() and launcher_gone(launcher):
                shutil.rmtree(folder, ignore_errors=True)  # nobody is left to remove it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        if not _stop_signal:
            first_at.append(now)
        _stop_signal.append(signum)

    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, note)
    if folder is not None and heartbeat:
        _heartbeat = Heartbeat(Path(folder), rank)
    parent_watch = ParentWatch(rank, folder) if launched() else None
    try:
        yield
    finally:
        if parent_watch is not None:
            parent_watch.close()
        if _heartbeat is not None:
            _heartbeat.close()
            _heartbeat = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------------------------
# in the launcher


def rank_pids(folder: Path) -> dict[int, int]:
    """Rank -> pid, from the pid files the ranks write as they start."""
    pids: dict[int, int] = {}
    for path in Path(folder).glob("rank*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids[int(path.stem.removeprefix("rank"))] = int(path.read_text())
    return pids


def _kill(pids: dict[int, int], signum: int) -> None:
    for pid in pids.values():
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


@contextlib.contextmanager
def forward_signals(folder: Path) -> Iterator[list[int]]:
    """While ranks run: pass SIGINT/SIGTERM on to them through a stop file they read at each step
    boundary (a second signal kills them); yields the signals received, for the caller's final word."""
    received: list[int] = []
    previous: dict[int, Any] = {}

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if len(received) == 1:  # a file, not the signal: with Ctrl-C the ranks have it already,
            (Path(folder) / STOP_FILE).write_text(str(signum))  # and a second one means "now"
        else:
            _kill(rank_pids(folder), signal.SIGKILL)

    # the launch config tells torch's launcher to leave these two alone (`local_launcher(own_signals)`)
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, forward)
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Watchdog:
    """A thread in the launcher that ends the run when no rank has moved on for `seconds`."""

    def __init__(self, folder: Path, world: int, seconds: float) -> None:
        self.folder, self.world, self.seconds = Path(folder), world, seconds
        self.verdict: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fivefold-watchdog", daemon=True)
        if seconds > 0:
            self._thread.start()

    def _beats(self) -> dict[int, tuple[dict[str, Any], float]]:
        beats = {}
        for rank in range(self.world):
            path = self.folder / f"rank{rank}.beat"
            with contextlib.suppress(OSError, ValueError):
                beats[rank] = (json.loads(path.read_text()), path.stat().st_mtime)
        return beats

    def _run(self) -> None:
        poll = min(0.5, self.seconds / 4)
        while not self._stop.wait(poll):
            beats = self._beats()
            if len(beats) < self.world:
                continue  # still starting: the rendezvous timeout covers that
            now = time.time()
            silent = any(now - mtime > self.seconds for _, mtime in beats.values())
            started = all(record["step"] >= 1 for record, _ in beats.values())
            last_move = max(record["moved_at"] for record, _ in beats.values())
            # a rank that stopped beating is stuck whatever it was doing; a rank that beats but
            # makes no progress only once training runs (start-up may legitimately take long)
            if not silent and not (started and now - last_move >= self.seconds):
                continue
            self.verdict = self._judge(beats, now)
            _kill(rank_pids(self.folder), signal.SIGKILL)  # SIGKILL: a stopped process ignores the rest
            return

    def _judge(self, beats: dict[int, tuple[dict[str, Any], float]], now: float) -> str:
        silent_after = min(self.seconds, max(3 * BEAT_SECONDS, self.seconds / 2))
        silent = [r for r, (_, mtime) in sorted(beats.items()) if now - mtime > silent_after]
        if silent:
            stuck, how = silent, "stopped responding (no heartbeat for {age:.0f} s)"
        else:
            low = min(record["step"] for record, _ in beats.values())
            stuck, how = (
                [r for r, (rec, _) in sorted(beats.items()) if rec["step"] == low],
                "made no progress",
            )
        first = beats[stuck[0]][0]
        age = now - beats[stuck[0]][1]
        names = ", ".join(map(str, stuck))
        # a silent rank's last heartbeat is up to a beat older than the moment it stopped
        where = "last heard" if silent else "while"
        return (
            f"watchdog: rank {names} {how.format(age=age)} {where} in {first['phase']} at step "
            f"{first['step']}; every rank was stopped (--watchdog {self.seconds:g} s)"
        )

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
