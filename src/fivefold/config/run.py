"""`TrainSpec` and `RunConfig`: one run's training settings and its whole configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fivefold.config.files import _from_dict, dumps_toml, read_toml, to_dict
from fivefold.config.layout import Layout
from fivefold.config.model import ModelSpec
from fivefold.errors import FivefoldError, suggest

DTYPES = ("fp32", "bf16")


# longer than any training run (Llama 3 405B: about 1.2 million steps); a bigger number is a typo
MAX_STEPS = 10**9
# sequences in a step or a micro-batch: a million times the largest published batches (a few thousand)
MAX_BATCH = 10**9


@dataclass
class TrainSpec:
    steps: int = 300
    seed: int = 0
    dtype: str = "fp32"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables
    seq_len: int = 128
    micro_batch: int = 8  # sequences per rank per forward
    global_batch: int = 0  # sequences per optimizer step; 0: micro_batch × data-parallel ranks
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 0  # 0: only at the end; -1: never (a benchmark that needs no weights)
    data: str = "stdlib"  # stdlib | path to a text file, folder, .jsonl or .bin
    tokenizer: str = "bytes"  # bytes | path to an HF tokenizer.json
    log_every: int = 10
    device: str = "auto"  # auto | cpu | cuda
    # saved-activation meter: a hook on every tensor autograd saves, so it is off unless asked for
    measure_memory_every: int = 0  # 0: never; N: steps 1, N+1, 2N+1, ... (and the last)
    compile: bool = False  # torch.compile each transformer block (fivefold.parallel.compile)
    profile_step: int = 0  # 0: off; N: torch.profiler trace of step N on every rank (run_dir/profile/)

    def validate(self) -> TrainSpec:
        if self.dtype not in DTYPES:
            raise FivefoldError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("steps", "seq_len", "micro_batch"):
            if getattr(self, name) <= 0:
                raise FivefoldError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.steps > MAX_STEPS:
            raise FivefoldError(
                f"--steps must be at most {MAX_STEPS:,} (a billion steps), got {self.steps:.3g}"
            )
        if self.global_batch < 0:
            raise FivefoldError("--global-batch must be >= 0")
        for name in ("global_batch", "micro_batch"):
            if getattr(self, name) > MAX_BATCH:
                flag = f"--{name.replace('_', '-')}"
                raise FivefoldError(f"{flag} must be at most {MAX_BATCH:,}, got {getattr(self, name):.3g}")
        if self.measure_memory_every < 0:
            raise FivefoldError(
                "--measure-memory-every must be >= 0 (0: off, 1: every step), "
                f"got {self.measure_memory_every}"
            )
        if not 0 <= self.profile_step <= self.steps:
            raise FivefoldError(
                f"--profile-step must be between 0 (off) and --steps {self.steps}, got {self.profile_step}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise FivefoldError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        positive = {"lr": "--lr", "eps": "eps"}
        for name, flag in positive.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise FivefoldError(f"{flag} must be a positive finite number, got {value}")
        for name in ("weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise FivefoldError(f"{name} must be a finite number >= 0 (0: off), got {value}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise FivefoldError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        at_least = {
            "eval_every": 1,
            "eval_batches": 1,
            "log_every": 1,
            "warmup_steps": 0,
            "checkpoint_every": -1,
        }
        for name, low in at_least.items():
            if getattr(self, name) < low:
                flag = {"warmup_steps": "--warmup"}.get(name, f"--{name.replace('_', '-')}")
                hint = " (0: only at the end, -1: never)" if name == "checkpoint_every" else ""
                raise FivefoldError(f"{flag} must be >= {low}{hint}, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**63:
            raise FivefoldError(f"--seed must be in 0..2^63-1, got {self.seed}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise FivefoldError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        return self

    def step_batch(self, data_parallel: int) -> int:
        """Sequences per optimizer step: --global-batch, else one micro-batch per data-parallel rank."""
        return self.global_batch or self.micro_batch * data_parallel

    def grad_accum(self, data_parallel: int) -> int:
        """Micro-batches each data-parallel rank accumulates per optimizer step."""
        gb = self.step_batch(data_parallel)
        per = self.micro_batch * data_parallel
        if gb % per:
            ok = [per * k for k in range(1, 9)]
            raise FivefoldError(
                f"--global-batch {gb} must be a multiple of micro_batch × data-parallel ranks = "
                f"{self.micro_batch}×{data_parallel} = {per}; valid: {suggest(ok)}"
            )
        return gb // per


@dataclass
class RunConfig:
    """Everything a training run needs; written as `config.toml` in the run directory."""

    model: ModelSpec
    train: TrainSpec = field(default_factory=TrainSpec)
    layout: Layout = field(default_factory=Layout)

    def to_toml(self) -> str:
        return dumps_toml(
            {"model": to_dict(self.model), "train": to_dict(self.train), "layout": to_dict(self.layout)}
        )

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        model, train, layout = run_tables(path)
        if model is None:
            raise FivefoldError(f"{path}: a run config needs a [model] table")
        if isinstance(model, str):  # a preset name or a model file, as `train --config` reads it
            from fivefold.config.presets import load_model

            spec = load_model(model)
        else:
            spec = _from_dict(ModelSpec, model, f"{path} [model]").validate()
        return cls(
            model=spec,
            train=_from_dict(TrainSpec, train, f"{path} [train]").validate(),
            layout=_from_dict(Layout, layout, f"{path} [layout]"),
        )


def run_tables(path: str | Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """A run config's (model, train, layout): the model a preset name, a model file or a table; the
    others tables (empty where absent). One line on anything else."""
    data = read_toml(path)
    unknown = sorted(set(data) - {"model", "train", "layout"})
    if unknown:
        raise FivefoldError(
            f"{path}: unknown table(s) {', '.join(unknown)}; a run config has model, train, layout"
        )
    model, train, layout = data.get("model"), data.get("train", {}), data.get("layout", {})
    if model is not None and not isinstance(model, str | dict):
        raise FivefoldError(
            f"{path}: model must be a preset name, a model file path or a [model] table, got {model!r}"
        )
    for name, table in (("train", train), ("layout", layout)):
        if not isinstance(table, dict):
            raise FivefoldError(f"{path}: {name} must be a [{name}] table, got {table!r}")
    return model, train, layout
