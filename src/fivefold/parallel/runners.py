"""The StepRunner for a layout: the plain runner, or the pipeline's (see fivefold.parallel.api)."""

from __future__ import annotations

from typing import Any

from torch import nn

from fivefold.config import Layout, TrainSpec
from fivefold.parallel.apply import parallelize_chunk
from fivefold.parallel.compile import check_compile
from fivefold.parallel.pipeline_runner import build_pipeline_runner
from fivefold.parallel.runner import ParallelRunner
from fivefold.support import check_trainable


def build_runner(model: nn.Module, runtime_mesh: Any, layout: Layout, train: TrainSpec):
    """A StepRunner for any layout; `model` is built on meta (or materialised identically on every rank)."""
    check_trainable(model.spec, layout, train.seq_len)
    if train.compile:
        check_compile(layout)
    if layout.pp > 1:
        return build_pipeline_runner(model, runtime_mesh, layout, train)
    wrapped = parallelize_chunk(model, runtime_mesh, layout, train)
    return ParallelRunner(model, wrapped, runtime_mesh, layout, train)
