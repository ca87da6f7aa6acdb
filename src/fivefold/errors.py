"""The one exception type users see: a violated constraint, said plainly, with exit code 2."""

from __future__ import annotations

import difflib
import errno
import os
import re
from collections.abc import Iterable


class FivefoldError(Exception):
    """Bad input: the CLI prints the message (no traceback) and exits with code 2."""

    exit_code = 2
    label = "error"  # the word after the command in its one line


# writes the storage refuses, whatever the command: no space, a quota, a file-size limit (`ulimit -f`),
# a file system gone read-only, a failing device. Faults of the machine, not of the input: exit code 1
STORAGE_FAULTS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)


class StorageFault(FivefoldError):
    """A write the storage refused (`STORAGE_FAULTS`): one line naming the file, exit code 1."""

    exit_code = 1


def storage_fault(exc: BaseException, where: object = None) -> str | None:
    """The one line for a write the storage refused ("No space left on device: FILE"; the file, or
    `where` when the error does not name one), or None for any other error."""
    if not isinstance(exc, OSError) or exc.errno not in STORAGE_FAULTS:
        return None
    file = exc.filename or where
    return f"{exc.strerror or os.strerror(exc.errno)}" + (f": {file}" if file else "")


def reason(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line for a one-line message, without the interpreter's own advice (a
    number of 5,000 digits comes with "use sys.set_int_max_str_digits()")."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text.split("; use sys.set_int_max_str_digits")[0][:limit]


def suggest(values: Iterable[object], limit: int = 8) -> str:
    """Render a short 'valid choices' list for an error message."""
    items = [str(v) for v in values]
    more = len(items) - limit
    shown = ", ".join(items[:limit])
    return shown + (f", … ({more} more)" if more > 0 else "")


def _folded(name: str) -> str:
    """A name as people vary it: no owner prefix ("meta-llama/"), case or separators."""
    return re.sub(r"[^a-z0-9]", "", name.rsplit("/", 1)[-1].lower())


def closest(name: str, choices: Iterable[str], limit: int = 3) -> list[str]:
    """The choices `name` most likely meant: the same once case and separators are set aside, those it
    begins ("H100" -> h100-80gb, h100-nvl, ...), else the nearest spellings; [] when none is close."""
    options = list(choices)
    folded = {c: _folded(c) for c in options}
    want = _folded(name)
    if not want:
        return []
    same = [c for c in options if folded[c] == want]
    if same:
        return same[:limit]
    begun = [c for c in options if folded[c].startswith(want)]
    if begun:
        return begun[:limit]
    near = difflib.get_close_matches(want, list(folded.values()), n=limit, cutoff=0.75)
    return [c for c in options if folded[c] in near][:limit]


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """ " (did you mean a, b?)" for an error message, or "" where no choice is close."""
    near = closest(name, choices)
    return f" (did you mean {', '.join(near)}?)" if near else ""


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending (pairs up to sqrt(n): a world size of 10^12 stays quick)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]
