"""Reading and writing config files: TOML in, dataclasses out, with errors that name the field."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

from fivefold.errors import FivefoldError, reason, suggest

T = TypeVar("T")


def _from_dict(cls: type[T], data: dict[str, Any], what: str) -> T:
    """Build a dataclass from a dict, rejecting unknown keys and coercing simple types."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise FivefoldError(
            f"unknown key(s) {', '.join(unknown)} in {what}; valid keys: {suggest(sorted(known), 40)}"
        )
    required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
    if missing := [n for n in required if n not in data]:
        raise FivefoldError(f"{what}: missing key(s) {', '.join(missing)}; required: {', '.join(required)}")
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


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise FivefoldError(f"file not found: {p}")
    if p.is_dir():
        raise FivefoldError(f"{p} is a directory; a TOML file is expected here")
    try:
        return tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise FivefoldError(f"cannot read {p}: {exc}") from None
    except (ValueError, RecursionError) as exc:  # not TOML, a 5000-digit number, nesting 10^5 deep
        raise FivefoldError(f"malformed TOML in {p}: {reason(exc)}") from None


def dumps_toml(data: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(data)
