"""What a command writes: a file where the user said (`--out`), whole or not at all, and a path that
cannot take it is one line naming the flag and the path; and the terminal output of a long job, which
outlives a reader that went away."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from fivefold.errors import FivefoldError, StorageFault, storage_fault


def check_not_an_input(out: str | Path, inputs: Iterable[str | Path | None], flag: str = "--out") -> None:
    """Refuse an output path that is one of the files the command reads (the same file, by any name
    or link): writing it would replace what was read, a model or a run's config turned into a page."""
    for given in inputs:
        if not given:
            continue
        with contextlib.suppress(OSError):  # a path that is not there cannot be the same file
            if os.path.samefile(out, given):
                raise FivefoldError(
                    f"{flag} {out} is {given}, which this command reads: writing it would replace it; "
                    "pick another file"
                )


def write_text_whole(path: Path, text: str, flag: str = "--out") -> None:
    """Write `text` to `path`, whole or not at all (`write_whole`)."""
    write_whole(path, lambda target: Path(target).write_text(text), flag)


def write_whole(path: Path, write: Callable[[Path], object], flag: str = "--out") -> None:
    """Have `write(target)` write `path`, whole or not at all. A file goes through a temporary file
    beside it, so no half-written file is left (nor an earlier one cut short); where `path` is a link,
    beside the file it names, so the link stays. A character device or a FIFO (/dev/null,
    /dev/stdout, a named pipe) is written into, as a shell's `>` would, never replaced by a file; a
    directory or a socket is refused. A write the storage refuses (a full disk) is a `StorageFault`."""
    try:
        mode: int | None = os.stat(path).st_mode  # through links
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # a name too long, a loop of links, a file where a directory belongs
        raise FivefoldError(f"{flag} {path}: cannot write there ({_why(path, exc)})") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise FivefoldError(f"{flag} {path}: cannot write there (it is a directory; give a file name in it)")
    if mode is not None and _written_into(mode):
        try:
            write(Path(path))
        except OSError as exc:  # /dev/full
            raise _refused(flag, path, str(exc.strerror or exc), exc) from None
        return
    if mode is not None and not stat.S_ISREG(mode):
        raise FivefoldError(f"{flag} {path}: not a file, a device or a FIFO (a socket?); cannot write there")
    target = Path(os.path.realpath(path))  # a link's file, also where the link dangles
    tmp = target.with_name(target.name + ".tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        tmp.replace(target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _refused(flag, path, _why(path, exc), exc) from None


def _refused(flag: str, path: Path, why: str, exc: OSError) -> FivefoldError:
    """The one line for an output that could not be written: bad input (exit 2), or the storage's
    refusal, a fault of the machine (exit 1)."""
    kind = StorageFault if storage_fault(exc) is not None else FivefoldError
    return kind(f"{flag} {path}: cannot write there ({why})")


def is_stream(path: str | Path) -> bool:
    """A character device or a FIFO (/dev/stdout, /dev/null, a named pipe): written into, so the
    file name's suffix says nothing about what it takes."""
    try:
        return _written_into(os.stat(path).st_mode)
    except OSError:
        return False


def _written_into(mode: int) -> bool:
    """A character device or a FIFO: written into, never replaced by a file."""
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _why(path: Path, exc: OSError) -> str:
    blocking = None
    with contextlib.suppress(OSError):
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    return f"{blocking} is a file, not a directory" if blocking else str(exc.strerror or exc)


def tolerate_any_encoding() -> None:
    """stdout and stderr replace what their encoding cannot hold (×, —, ░ under LANG=C with
    PYTHONUTF8=0, or PYTHONIOENCODING=ascii) instead of failing the command that prints it."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):  # a stream without the method
            stream.reconfigure(errors="replace")


class ReaderGoneStream:
    """A text stream that outlives its reader: once a write finds the pipe closed (`train | head`,
    a `tee` that died), this stream and its file descriptor write to /dev/null from then on. A job's
    progress lines must not decide whether the job finishes, or what it exits with."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _drop_reader(self) -> None:
        devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process's stream
        with contextlib.suppress(OSError, ValueError, AttributeError):  # not a real file (captured)
            os.dup2(devnull.fileno(), self._stream.fileno())  # C-level writes and the final flush too
        self._stream = devnull

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop_reader()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop_reader()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ... of the stream in use
        return getattr(self._stream, name)


def write_without_a_reader() -> tuple[Any, Any]:
    """Make stdout and stderr `ReaderGoneStream`s (a rank does for the rest of its life); returns the
    streams they were."""
    tolerate_any_encoding()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = ReaderGoneStream(sys.stdout), ReaderGoneStream(sys.stderr)
    return saved


@contextlib.contextmanager
def outlive_the_reader() -> Iterator[None]:
    """Within it, stdout and stderr are `ReaderGoneStream`s; the streams before are restored after."""
    saved = write_without_a_reader()
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
