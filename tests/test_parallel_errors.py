"""Layouts the parallel code cannot apply are refused with a message naming the constraint."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from fivefold.config import Layout, load_model
from fivefold.errors import FivefoldError
from fivefold.parallel.tensor import check_tensor_parallel
from fivefold.support import check_trainable


def test_tp_must_divide_query_heads() -> None:
    with pytest.raises(FivefoldError, match=r"--tp 3 .*4 query heads.*valid tp: 1, 2, 4"):
        check_tensor_parallel(load_model("tiny"), 3)


def test_tp_above_kv_heads_must_be_a_multiple_of_them() -> None:
    spec = dataclasses.replace(load_model("tiny"), heads=6, kv_heads=4, hidden=48)
    with pytest.raises(FivefoldError, match=r"4 KV heads"):
        check_tensor_parallel(spec, 6)
    check_tensor_parallel(load_model("tiny"), 4)  # 2 KV heads, tp 4: replicated, accepted


def test_tp_must_divide_ffn_and_vocab() -> None:
    spec = dataclasses.replace(load_model("tiny"), vocab=250)
    with pytest.raises(FivefoldError, match=r"vocab = 250"):
        check_tensor_parallel(spec, 4)


def test_zero1_needs_plain_replicas() -> None:
    with pytest.raises(FivefoldError, match=r"--zero 1 .*--fsdp"):
        check_trainable(load_model("tiny"), Layout(dp=2, tp=2, zero=1).resolve(4))
    check_trainable(load_model("tiny"), Layout(dp=2, zero=1).resolve(2))


def test_verify_rejects_bad_layout_without_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fivefold", "verify", "--nproc", "3", "--tp", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--tp 3" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
