"""The strategy picker's prices: each strategy alone on a small cluster, planned for the model.

Each card is one layout with a single strategy switched on, planned by `plan`; the page shows
the collectives of that strategy's axis (which op, how many a step, over which link, payload
bytes) and the memory per GPU it leaves. What each strategy cuts is a fixed picture on the page.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.errors import FivefoldError
from fivefold.mesh import resolve_layout
from fivefold.plan import TrainShape, plan
from fivefold.plan.search import plan_flags
from fivefold.plan.trainers import runtime_kernel

# name, what it cuts, layout on n GPUs (n = one node; HSDP two), axes whose collectives it pays
STRATEGIES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("DP", "the batch", "dp", ("dp",)),
    ("ZeRO-1", "the batch and the optimizer state", "zero1", ("dp",)),
    ("ZeRO-2", "the batch, optimizer state and gradients", "zero2", ("fsdp",)),
    ("FSDP / ZeRO-3", "the batch and all model state", "fsdp", ("fsdp", "fsdp_cp")),
    ("HSDP", "model state inside a node, the batch across nodes", "hsdp", ("fsdp", "fsdp_cp", "dp")),
    ("TP + SP", "each layer's matmuls (and the norms' sequence)", "tp", ("tp",)),
    ("PP", "the stack of layers", "pp", ("pp",)),
    ("EP", "the experts", "ep", ("ep", "expert_fsdp")),
    ("CP", "the sequence", "cp", ("cp",)),
)


def _layout(kind: str, n: int) -> Layout:
    return {
        "dp": Layout(dp=n, zero=0),
        "zero1": Layout(dp=n, zero=1),
        "zero2": Layout(fsdp=n, zero=2),
        "fsdp": Layout(fsdp=n, zero=3),
        "hsdp": Layout(fsdp=n, dp=2, zero=3),
        "tp": Layout(tp=n, sp=True),
        "pp": Layout(pp=n, pp_schedule="1f1b"),
        "ep": Layout(fsdp=n, ep=n, zero=3),
        "cp": Layout(cp=n, zero=0),
    }[kind]


def strategy_cards(
    model: ModelSpec, hw: HardwareSpec, seq_len: int, gpus_per_node: int, base: TrainShape | None = None
) -> list[dict[str, Any]]:
    """One card a strategy on one node, planned in the page's dtype and kernels (`base`: the page's
    shape; its batch is the card's own: one micro-batch a data rank, two a stage with a pipeline)."""
    base = base or TrainShape(seq_len=seq_len, global_batch=1)
    n = gpus_per_node
    cards = []
    for name, cuts, kind, axes in STRATEGIES:
        lay = resolve_layout(_layout(kind, n), _layout(kind, n).world)
        card: dict[str, Any] = {"name": name, "cuts": cuts, "kind": kind, "gpus": lay.world}
        data = lay.dp * lay.fsdp
        shape = dataclasses.replace(
            runtime_kernel(base, hw.name),
            seq_len=seq_len,
            global_batch=data * (2 * lay.pp if lay.pp > 1 else 1),
            micro_batch=1,
        )
        card["global_batch"] = shape.global_batch
        try:
            if kind == "ep" and not model.is_moe:
                raise FivefoldError(
                    f"{model.name} has no experts: expert parallelism needs a mixture-of-experts model"
                )
            planned = plan(model, hw, lay, shape, gpus_per_node)
            p = planned.to_json()
        except FivefoldError as exc:
            card["error"] = str(exc)
        else:
            # the batch split too: on a CPU device plan and train take micro-batch 8 unless told
            card["flags"] = plan_flags(planned)
            card["comm"] = [c for c in p["comm"] if c["axis"] in axes]
            card["memory"] = p["memory"]
            card["memory_capacity"] = p["memory_capacity"]
            card["fits"] = p["fits"]
        cards.append(card)
    return cards
