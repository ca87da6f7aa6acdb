"""What a command writes: a file where the user said (`--out`), whole or not at all, and a path that
cannot take it is one line naming the flag and the path; and the terminal output of a long job, which
outlives a reader that went away."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fivefold.errors import FivefoldError


def write_text_whole(path: Path, text: str, flag: str = "--out") -> None:
    """Write `text` to `path` through a temporary file beside it, so no half-written file is left."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        why = f"{blocking} is a file, not a directory" if blocking else exc.strerror or exc
        raise FivefoldError(f"{flag} {path}: cannot write there ({why})") from None


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
