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


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, corpus) -> Path:
    """A finished one-step run of the tiny model (config, metrics, ledger, trace, a checkpoint)."""
    from fivefold.cli import main

    run = tmp_path_factory.mktemp("tiny_run") / "run"
    argv = ["train", "--model", "tiny", "--steps", "1", "--seq-len", "16", "--micro-batch", "2"]
    argv += ["--data", corpus, "--device", "cpu", "--no-progress", "--run-dir", str(run)]
    assert main(argv) == 0
    return run
