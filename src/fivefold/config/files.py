"""Reading and writing config files: TOML in, dataclasses out, with errors that name the field."""

from __future__ import annotations

import dataclasses
import os
import stat
import tomllib
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

from fivefold.errors import FivefoldError, reason, suggest

T = TypeVar("T")


def _from_dict(cls: type[T], data: dict[str, Any], what: str, implied: tuple[str, ...] = ()) -> T:
    """Build a dataclass from a dict, rejecting unknown keys and coercing simple types. `implied`: keys
    the loader fills when the file leaves them out (a file's name), not named as required."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise FivefoldError(
            f"unknown key(s) {', '.join(unknown)} in {what}; valid keys: {suggest(sorted(known), 40)}"
        )
    required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
    if missing := [n for n in required if n not in data]:
        needed = ", ".join(n for n in required if n not in implied)
        raise FivefoldError(f"{what}: missing key(s) {', '.join(missing)}; required: {needed}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, known[name], what)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required key is missing
        raise FivefoldError(f"{what}: {exc}") from None


def _coerce(value: Any, f: dataclasses.Field, what: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if value is None and "None" not in kind:
            raise ValueError  # JSON's null (TOML has none) where a value must be
        if kind.startswith(("int", "float")) and isinstance(value, str | bool):
            raise ValueError  # a number written as a string, or `true` (an int to Python), is a mistake
        if kind.startswith("str") and value is not None and not isinstance(value, str):
            raise FivefoldError(f"{what}: {f.name} must be a string, got {value!r}")
        if kind.startswith("int") and value is not None:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind.startswith("float") and value is not None:
            return float(value)
        if kind.startswith("bool") and not isinstance(value, bool):
            # "no" or 5 would otherwise read as a truth value nobody wrote
            words = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
            words |= {"on": True, "off": False}
            if not isinstance(value, str) or value.lower() not in words:
                raise ValueError
            return words[value.lower()]
    except (TypeError, ValueError, OverflowError):  # OverflowError: a 400-digit int as a float
        raise FivefoldError(f"{what}: {f.name} must be {kind}, got {str(value)[:40]!r}") from None
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as a TOML-friendly dict (None values dropped: TOML has no null)."""
    return {k: v for k, v in dataclasses.asdict(obj).items() if v is not None}


# a settings file (model, hardware, run config, runs) is kilobytes; the bundled runs sets are under 1 MB
MAX_SETTINGS_BYTES = 16 * 2**20


def read_settings_text(path: str | Path, what: str = "file") -> str:
    """The text of a user's settings file: a regular file (a device or a FIFO would be read without
    end, or block), at most MAX_SETTINGS_BYTES, in UTF-8; anything else is one line naming it."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise FivefoldError(f"{what} not found: {p}") from None
    except OSError as exc:  # a name too long, a loop of links, no permission on a parent
        raise FivefoldError(f"cannot read {what} {p}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise FivefoldError(f"{p} is a directory; a {what} is expected here")
    if not stat.S_ISREG(mode):
        raise FivefoldError(f"{what} {p} is not a regular file (a device, a FIFO or a socket)")
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_SETTINGS_BYTES + 1)
    except OSError as exc:
        raise FivefoldError(f"cannot read {what} {p}: {exc.strerror}") from None
    if len(data) > MAX_SETTINGS_BYTES:
        limit = MAX_SETTINGS_BYTES // 2**20
        raise FivefoldError(f"{what} {p} is larger than {limit} MB; not a settings file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FivefoldError(f"cannot read {what} {p} as UTF-8 text (byte {exc.start})") from None


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    text = read_settings_text(p, "TOML file")
    try:
        return tomllib.loads(text)
    except (ValueError, RecursionError) as exc:  # not TOML, a 5000-digit number, nesting 10^5 deep
        raise FivefoldError(f"malformed TOML in {p}: {reason(exc)}") from None


def dumps_toml(data: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(data)
