"""CPU ranks keep freed memory mapped: a step's fresh tensors are not faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fivefold.train import host_memory

# Four "steps", each allocating and touching the same tensors (288 MB) and freeing them; print the
# page faults of the last: what a training step pays once the run is under way.
PROBE = """
import resource, torch
from fivefold.train.host_memory import keep_freed_memory
applied = keep_freed_memory()
sizes = [12_582_912, 4_194_304, 33_554_432, 4_194_304] * 4
for step in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.empty(n).fill_(1.0) for n in sizes]
    del tensors
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = 4 * (12_582_912 + 2 * 4_194_304 + 33_554_432) * 4 // 4096


def _probe(**env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=clean | env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator settings")
def test_a_freed_block_is_reused_without_page_faults():
    applied, faults = _probe()
    if not applied:
        pytest.skip("this libc takes no mallopt settings")
    opted_out, faults_before = _probe(FIVEFOLD_KEEP_FREED_MEMORY="0")
    assert not opted_out
    assert faults_before > PAGES // 2  # glibc's default: every block mapped afresh, page by page
    assert faults < PAGES // 10  # kept: the pages of the steps before serve this one (seen: 0-2 %)


@pytest.mark.parametrize(
    "env, chose",
    [
        ({}, False),
        ({"FIVEFOLD_KEEP_FREED_MEMORY": "0"}, True),
        ({"LD_PRELOAD": "libjemalloc.so.2"}, True),
        ({"MALLOC_ARENA_MAX": "2"}, True),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, True),
    ],
)
def test_the_users_own_allocator_setup_is_left_alone(monkeypatch, env, chose):
    for key in list(os.environ):
        if key.startswith("MALLOC_") or key in ("LD_PRELOAD", "GLIBC_TUNABLES", "FIVEFOLD_KEEP_FREED_MEMORY"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert host_memory.user_chose() is chose
