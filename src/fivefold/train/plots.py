"""The loss curve of a run: training loss per step and held-out loss where it was measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fivefold.outputs import write_whole


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line half-written when the run was killed
            continue
    return records


def plot_loss_curve(metrics_path: Path, out_path: Path, vocab: int | None = None) -> Path | None:
    """Write a PNG of train + held-out loss; returns None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # a line edited by hand, or written by something else, is left out rather than stop the plot
    records = [r for r in read_metrics(metrics_path) if _numeric(r, "step") and _numeric(r, "loss")]
    if not records:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.2, label="train")
    held = [r for r in records if _numeric(r, "held_out_loss")]
    if held:
        ax.plot([r["step"] for r in held], [r["held_out_loss"] for r in held], "o-", ms=4, label="held-out")
    if vocab:
        ax.axhline(math.log(vocab), color="grey", ls=":", lw=1, label=f"ln(vocab) = {math.log(vocab):.2f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:  # whole or not at all: a full disk leaves no cut picture
        write_whole(out_path, lambda target: fig.savefig(target, format="png"), "output")
    finally:
        plt.close(fig)
    return out_path


def _numeric(record: object, key: str) -> bool:
    value = record.get(key) if isinstance(record, dict) else None
    return isinstance(value, int | float) and not isinstance(value, bool)
