"""A run's metrics.jsonl as every reader takes it: one JSON value a line. A run killed mid-write
leaves its last line half-written; that line is skipped, so a run in progress or one that was
stopped reads like the steps it finished. A bad line before the last is an error."""

from __future__ import annotations

import json
import math
from typing import Any

from fivefold.errors import FivefoldError


def json_lines(text: str, where: str) -> list[tuple[int, Any]]:
    """(line number, value) of each non-blank line of `text`; `where` starts the error's line."""
    lines = text.splitlines()
    last = max((n for n, line in enumerate(lines, start=1) if line.strip()), default=0)
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except (ValueError, RecursionError):  # not JSON, a 5000-digit number, deep nesting
            if n == last:
                continue
            raise FivefoldError(f"{where}: line {n} is not JSON: {line[:60]!r}") from None
    return out


def finite_number(value: Any) -> bool:
    """A real number read from a run's files that is neither NaN nor infinite (JSON's NaN and Infinity
    read as floats, and true as 1): what a step, a time, a duration or a count must be."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
