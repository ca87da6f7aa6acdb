"""The pipeline tests' cases for the shared harness (tests/harness.py), and what they read back.

Every case trains its pipelined chunks for 5 AdamW steps at lr 1e-2 with clipping at 0.05, one
micro-batch of `MICRO` sequences per pipeline micro-batch, through the project's runner; the
harness holds it to the single-process model on the same global batches, eval loss included.
Adam's eps is 1e-6, as in the layout matrix: with torch's 1e-8, an embedding element whose gradient
is ~0 up to rounding gets an update decided by the rounding (3e-4 apart on these batches under
fsdp or tp), which would hide a real difference rather than show one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fivefold.config import TrainSpec
from harness import Case

SEQ = 16
MICRO = 2  # sequences per pipeline micro-batch
STEPS = 5
TRAIN = TrainSpec(seq_len=SEQ, micro_batch=MICRO, seed=7, lr=1e-2, eps=1e-6, grad_clip=0.05)


def pipeline_case(
    world: int, model: str = "tiny", layers: int | None = None, ledger: bool = False, **layout: Any
) -> Case:
    """A pipelined layout; with `ledger`, the comm ledger records every step after the first (which
    also exchanges the stages' shapes)."""
    return Case(
        model,
        layout,
        world,
        TRAIN,
        STEPS,
        accumulation=layout["microbatches"],
        layers=layers,
        ledger_steps=tuple(range(1, STEPS)) if ledger else (),
        activations=True,
        evaluate=True,
    )


def p2p(result: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Mean (count, bytes) per step of the stage hand-overs (`pp` send / recv) in the forward +
    backward of the steps the ledger recorded."""
    steps = [fwd_bwd for fwd_bwd, _ in result["ledger"]]
    out = {}
    for op in ("send", "recv"):
        rows = [row for step in steps for row in step if row["axis"] == "pp" and row["op"] == op]
        out[op] = (sum(r["count"] for r in rows) / len(steps), sum(r["bytes"] for r in rows) / len(steps))
    return out


def train_briefly(rank: int, world: int, train_dir: str, layout: dict[str, Any]) -> None:
    """A short real training run through the loop (metrics, trace, ledger, report inputs)."""
    from fivefold.config import Layout, RunConfig, load_model
    from fivefold.train.loop import train

    cfg = RunConfig(  # tied: the two pp ranks holding the embedding and the head sum its gradient
        model=dataclasses.replace(load_model("tiny"), tie_embeddings=True),
        layout=Layout(**layout),
        train=TrainSpec(
            steps=3, seq_len=32, micro_batch=4, eval_every=3, eval_batches=2, warmup_steps=1, log_every=1
        ),
    )
    train(cfg, train_dir, progress=False)
