"""Spawned-rank body for the every-axis tests: train layouts, report what the single process checks.

Each case is (model, layout kwargs). Every rank trains the layout for `STEPS` steps from the seeded
init on the same global batches as the single-process reference, then reports its losses, its
gathered parameters (pipeline ranks hold different chunks: the test merges them), the expert
parameter bytes it holds, the wall time, comm ledger and rows its experts received of each step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings

import torch

from fivefold.config import Layout, ModelSpec, TrainSpec, load_model

STEPS = 2
TRAIN = TrainSpec(seq_len=16, micro_batch=2, lr=1e-3, eps=1e-6, grad_clip=0.3, seed=3)


def model_spec(name: str) -> ModelSpec:
    if name == "tied":  # input and output embeddings share one weight
        return dataclasses.replace(load_model("tiny"), name="tied", tie_embeddings=True)
    return load_model(name)


def layout_and_rows(world: int, lay: dict) -> tuple[Layout, TrainSpec, int]:
    """The resolved layout, the train spec and the global batch rows (one pipeline micro-batch of
    `micro_batch` rows per data-parallel rank, or two accumulation steps without a pipeline)."""
    layout = Layout(**lay).resolve(world)
    accumulation = layout.microbatches if layout.pp > 1 else 2
    rows = TRAIN.micro_batch * layout.dp * layout.fsdp * accumulation
    return layout, dataclasses.replace(TRAIN, global_batch=rows), rows


def run_cases(rank: int, world: int, cases: list[tuple[str, dict]], steps: int = STEPS) -> list[dict]:
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    from fivefold.measure.ledger import CommLedger
    from fivefold.measure.memory import local_tensor
    from fivefold.parallel.compare import build_layout, rows_received, train_steps
    from fivefold.parallel.device_mesh import build_runtime_mesh

    out = []
    for model, lay in cases:
        spec = model_spec(model)
        layout, train, rows = layout_and_rows(world, lay)
        mesh = build_runtime_mesh(layout)
        runner, optimizers = build_layout(spec, train, layout, mesh)
        times: list[float] = []
        received: list[int] = []
        ledger = CommLedger(mesh)

        def hook(
            at: int, phase: str, times: list = times, received: list = received, ledger=ledger, runner=runner
        ) -> None:
            if phase == "begin":
                times.append(time.perf_counter())
                received.append(-rows_received(runner))
            elif phase == "end":
                times[-1] = time.perf_counter() - times[-1]
                received[-1] += rows_received(runner)
                ledger.next_step()

        with ledger:
            result = train_steps(spec, train, rows, steps, mesh, runner, optimizers, hook)
        experts = [
            local_tensor(p)
            for part in runner.model_parts
            for n, p in part.named_parameters()
            if ".experts." in n
        ]
        out.append(
            {
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "params": result.params,
                "expert_bytes": sum(t.numel() * t.element_size() for t in experts),
                "seconds": times,
                "ledger": ledger.per_step(),
                "received": received,
            }
        )
        del runner, optimizers
        torch.distributed.barrier()
    return out
