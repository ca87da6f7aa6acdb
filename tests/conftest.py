"""Fixtures shared by several test files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """A small, fixed text corpus: the sources of the stdlib's json package (fast to read)."""
    path = tmp_path_factory.mktemp("corpus") / "code.txt"
    path.write_bytes(b"".join(p.read_bytes() for p in sorted(Path(json.__file__).parent.glob("*.py"))))
    return str(path)
