"""The values `plan` and `explore` assume when a flag is left out, in one place, and the line that
says so: a plan built on a guessed cluster or batch must not read as if the user had chosen them."""

from __future__ import annotations

import sys

HARDWARE = "h100-80gb"
SEQ_LEN = 4096
TOKENS_PER_STEP = 4 * 2**20  # a common pre-training batch: about 4M tokens per optimizer step


def seq_len(max_seq_len: int) -> int:
    """SEQ_LEN, or the model's positions where it has fewer."""
    return min(SEQ_LEN, max_seq_len)


def global_batch(gpus: int, seq_len: int, micro_batch: int = 1) -> int:
    """About 4M tokens per step, and at least one micro-batch per GPU; a multiple of the world size
    times the micro-batch, so that every data-parallel degree the world allows divides it into whole
    micro-batches."""
    per_gpu = max(1, -(-TOKENS_PER_STEP // (seq_len * gpus)))
    per_gpu = -(-per_gpu // micro_batch) * micro_batch
    return per_gpu * gpus


def say_assumed(assumed: dict[str, object]) -> None:
    """One line on stderr (stdout stays clean for --json) naming each value that was assumed."""
    if assumed:
        flags = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in assumed.items())
        print(f"assuming {flags} (give them to plan your own)", file=sys.stderr)
