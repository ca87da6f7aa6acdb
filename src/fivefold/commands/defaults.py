"""The values `plan` and `explore` assume when a flag is left out, in one place, and the line that
says so: a plan built on a guessed cluster or batch must not read as if the user had chosen them."""

from __future__ import annotations

import sys

from fivefold.config import HardwareSpec, TrainSpec

HARDWARE = "h100-80gb"
SEQ_LEN = 4096
TOKENS_PER_STEP = 4 * 2**20  # a common pre-training batch: about 4M tokens per optimizer step
TRAIN = TrainSpec()  # what `fivefold train` runs when a flag is left out


def on_a_cpu(hw: HardwareSpec) -> bool:
    """Whether `hw` is a CPU device (the `cpu` preset, or a file `--calibrate` wrote from its runs:
    its cores compute and communicate in turn), where `fivefold train` runs on a laptop. There a flag
    left out takes train's default, so that the plan is of the run train makes of the same flags."""
    return not hw.comm_overlap


def dtype(hw: HardwareSpec) -> str:
    """Train's dtype on a CPU device (fp32); elsewhere what GPU training runs (bf16)."""
    return TRAIN.dtype if on_a_cpu(hw) else "bf16"


def seq_len(max_seq_len: int, hw: HardwareSpec | None = None) -> int:
    """SEQ_LEN (train's on a CPU device), or the model's positions where it has fewer."""
    return min(TRAIN.seq_len if hw is not None and on_a_cpu(hw) else SEQ_LEN, max_seq_len)


def micro_batch(hw: HardwareSpec) -> int | None:
    """Train's micro-batch on a CPU device; elsewhere None (a plan takes 1, a search chooses)."""
    return TRAIN.micro_batch if on_a_cpu(hw) else None


def global_batch(
    gpus: int, seq_len: int, micro_batch: int = 1, hw: HardwareSpec | None = None, data_ranks: int = 0
) -> int:
    """On a CPU device train's step: a micro-batch on each data rank (`data_ranks`, or every GPU where
    the layout is still to be searched). Elsewhere about 4M tokens per step, and at least one
    micro-batch per GPU; a multiple of the world size times the micro-batch, so that every
    data-parallel degree the world allows divides it into whole micro-batches."""
    if hw is not None and on_a_cpu(hw):
        return micro_batch * (data_ranks or gpus)
    per_gpu = max(1, -(-TOKENS_PER_STEP // (seq_len * gpus)))
    per_gpu = -(-per_gpu // micro_batch) * micro_batch
    return per_gpu * gpus


def say_assumed(assumed: dict[str, object]) -> None:
    """One line on stderr (stdout stays clean for --json) naming each value that was assumed."""
    if assumed:
        flags = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in assumed.items())
        them = "them" if len(assumed) > 1 else "it"
        print(f"assuming {flags} (give {them} to plan your own)", file=sys.stderr)
