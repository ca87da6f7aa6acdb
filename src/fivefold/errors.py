"""The one exception type users see: a violated constraint, said plainly, with exit code 2."""

from __future__ import annotations

from collections.abc import Iterable


class FivefoldError(Exception):
    """Bad input: the CLI prints the message (no traceback) and exits with code 2."""

    exit_code = 2
    label = "error"  # the word after the command in its one line


def suggest(values: Iterable[object], limit: int = 8) -> str:
    """Render a short 'valid choices' list for an error message."""
    items = [str(v) for v in values]
    more = len(items) - limit
    shown = ", ".join(items[:limit])
    return shown + (f", … ({more} more)" if more > 0 else "")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
