"""A file a command writes where the user said (`--out`): whole or not at all, and a path that cannot
take it is one line naming the flag and the path."""

from __future__ import annotations

import contextlib
from pathlib import Path

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
        raise FivefoldError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None
