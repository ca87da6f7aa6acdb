"""One harness for the tests that train a layout on spawned ranks and hold it to the single process.

    from harness import Batch, Case, Tolerance, assert_matches

    CASES = Batch([Case("tiny", dict(dp=2), world=2, train=TRAIN, steps=3)])

    def test_dp(case=CASES.cases[0]):
        assert_matches(case, CASES.ranks(case), Tolerance(loss_rel=1e-5, param_abs=1e-5))

* A `Case` is a model, a layout (Layout's keyword arguments), a world size, a TrainSpec, a number
  of steps, the micro-batches per data-parallel rank, and what to measure on the way (the comm
  ledger of some steps, the state bytes, the saved activations, the eval loss).
* `Batch` runs its cases in one spawn per world size (`run_distributed`), on first use, and keeps
  the results for the session. Every rank trains each case with the project's runner
  (`fivefold.parallel.compare.build_layout` → `build_runner`) through the project's step loop
  (`train_steps`), so the tests exercise the code that `verify` and the CLI use.
* `reference(case)` is the single-process run on the same weights and global batches, computed
  once per (model, train spec, rows, steps) in the test process.
* `assert_matches` compares losses, gradient norms, eval loss and the updated parameters with the
  tolerances the caller names.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from distributed import run_distributed
from fivefold.config import Layout, ModelSpec, TrainSpec, load_model

# a model whose vocabulary (250) does not divide by 4: FSDP pads it
ODD = dict(name="odd", layers=2, hidden=24, heads=4, kv_heads=2, ffn_hidden=40, vocab=250, max_seq_len=64)


def model_spec(name: str, layers: int | None = None) -> ModelSpec:
    """A model by name, with the tests' variants: `odd` (vocabulary not divisible by 4), `tied`
    (input and output embeddings share one weight), `aux` (tiny-moe with the sequence-wise
    auxiliary loss on, so its gradient reaches the router)."""
    if name == "odd":
        spec = ModelSpec(**ODD).validate()
    elif name == "tied":
        spec = dataclasses.replace(load_model("tiny"), name="tied", tie_embeddings=True)
    elif name == "aux":
        spec = dataclasses.replace(load_model("tiny-moe"), name="aux", aux_loss_coef=0.01)
    else:
        spec = load_model(name)
    return dataclasses.replace(spec, layers=layers) if layers else spec


@dataclass
class Case:
    """One layout trained on `world` ranks, and what to record while it trains."""

    model: str
    layout: dict[str, Any]
    world: int
    train: TrainSpec
    steps: int
    # micro-batches of train.micro_batch rows per data-parallel rank and step (None: the pipeline's)
    accumulation: int | None = 2
    layers: int | None = None  # override the model's layer count
    ledger_steps: tuple[int, ...] = ()  # steps whose collectives the ledger records
    memory: bool = False  # state bytes and parameter storage of the first model part
    activations: bool = False  # peak saved-activation bytes of each forward + backward
    evaluate: bool = False  # eval loss on the global batch after the last step

    @property
    def id(self) -> str:
        layers = f"/{self.layers}" if self.layers else ""
        lay = ",".join(f"{k}{'' if v is True else v}" for k, v in self.layout.items())
        return f"w{self.world}-{self.model}{layers}:{lay}"

    def spec(self) -> ModelSpec:
        return model_spec(self.model, self.layers)

    def resolve(self) -> tuple[Layout, TrainSpec, int]:
        """The resolved layout, the train spec with its global batch, and the global rows."""
        layout = Layout(**self.layout).resolve(self.world)
        accumulation = layout.microbatches if self.accumulation is None else self.accumulation
        rows = self.train.micro_batch * layout.data_parallel * accumulation
        return layout, dataclasses.replace(self.train, global_batch=rows), rows


# ---- on every rank


def run_cases(rank: int, world: int, cases: list[Case], then: tuple | None = None) -> list[dict]:
    """Train every case in turn on a fresh mesh; then call `then = (fn, args)` as fn(rank, world, *args)."""
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # 2-D gather notes
    results = []
    for case in cases:
        results.append(_run_case(rank, case))
        torch.distributed.barrier()
    if then is not None:
        fn, args = then
        fn(rank, world, *args)
    return results


def _run_case(rank: int, case: Case) -> dict[str, Any]:
    from fivefold.measure.ledger import CommLedger
    from fivefold.measure.memory import ActivationMeter, local_tensor, state_bytes
    from fivefold.parallel.compare import build_layout, rows_received, train_steps
    from fivefold.parallel.device_mesh import build_runtime_mesh

    start = time.perf_counter()
    spec = case.spec()
    layout, train, rows = case.resolve()
    mesh = build_runtime_mesh(layout)
    runner, optimizers = build_layout(spec, train, layout, mesh)
    # built after the runner, as the training loop does: the mesh's groups all exist by then
    ledger = CommLedger(mesh) if case.ledger_steps else None
    received: list[int] = []
    peaks: list[int] = []
    meter: list[ActivationMeter] = []

    def hook(step: int, phase: str) -> None:
        recording = ledger is not None and step in case.ledger_steps
        if phase == "begin":
            if case.activations:
                meter[:] = [ActivationMeter().__enter__()]
            if recording:
                received.append(-rows_received(runner))
                ledger.__enter__()
        elif phase == "backward":
            if recording:  # the forward + backward, then the optimizer phase, as two ledger steps
                received[-1] += rows_received(runner)
                ledger.next_step()
            if case.activations:
                meter[0].__exit__(None, None, None)
                peaks.append(meter[0].peak_bytes)
        elif recording:
            ledger.next_step()
            ledger.__exit__(None, None, None)

    result = train_steps(spec, train, rows, case.steps, mesh, runner, optimizers, hook, case.evaluate)
    out: dict[str, Any] = {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "eval": result.eval_loss,
        # every rank gathers the full tensors; pipeline ranks hold different chunks
        "params": result.params if rank == 0 or layout.pp > 1 else None,
        "names": [n for part in runner.model_parts for n, _ in part.named_parameters()],
        "received": received,
        "activation_peak": max(peaks, default=0),
        "expert_bytes": sum(
            local_tensor(p).numel() * local_tensor(p).element_size()
            for part in runner.model_parts
            for n, p in part.named_parameters()
            if ".experts." in n
        ),
    }
    if ledger is not None:
        ledger.close()
        steps = ledger.per_step()
        out["ledger"] = [(steps[i], steps[i + 1]) for i in range(0, len(steps), 2)]
    if case.memory:
        part = runner.model_parts[0]
        out["memory"] = state_bytes([part], optimizers[0])
        out["storage"] = sum(local_tensor(p).untyped_storage().nbytes() for p in part.parameters())
        out["coords"] = {a: mesh.coord(a) for a in ("dp", "fsdp", "tp")}
    if layout.pp > 1:
        out.update(_pipeline_details(runner, mesh))
    out["seconds"] = time.perf_counter() - start
    return out  # the runner goes with this frame, before the next case builds its mesh


def _pipeline_details(runner: Any, mesh: Any) -> dict[str, Any]:
    """The split, this rank's stages, and what the timeline saw of the last step."""
    from fivefold.measure.timeline import COMPUTE_KINDS, gather_events, idle_fraction

    events = runner.timeline.events()
    last = max(e["args"]["step"] for e in events)
    everything = gather_events(runner.timeline)  # a collective: every rank takes part
    return {
        "split": runner.split,
        "stages": runner.stage_ids,
        "pp_rank": mesh.coord("pp"),
        "kinds": sorted(
            {
                (e["args"]["stage"], e["args"]["kind"], e["args"]["mb"])
                for e in events
                if e["args"]["step"] == last and e["args"]["kind"] in COMPUTE_KINDS
            }
        ),
        "comm_events": sum(1 for e in events if e["args"]["kind"] in ("send", "recv", "send/recv")),
        "measured_idle": idle_fraction(everything) if everything is not None else None,
    }


# ---- in the test process


@dataclass
class Batch:
    """Cases that run together: one spawn per world size on first use, results kept."""

    cases: list[Case]
    timeout: float = 400.0
    then: Callable[[], tuple] | None = None  # builds the (fn, args) every rank calls after the cases
    _results: dict[int, list[list[dict]]] = field(default_factory=dict)

    def ranks(self, case: Case) -> list[dict]:
        """What each rank reported for `case` (by rank)."""
        world = case.world
        if world not in self._results:
            mine = [c for c in self.cases if c.world == world]
            then = self.then() if self.then is not None else None
            per_rank = run_distributed(run_cases, world, mine, then, timeout=self.timeout)
            self._results[world] = [[per_rank[r][i] for r in range(world)] for i in range(len(mine))]
        index = [c for c in self.cases if c.world == world].index(case)
        return self._results[world][index]


_references: dict[tuple, Any] = {}


def reference(case: Case):
    """The single-process run of `case`'s model on the same global batches (cached)."""
    from fivefold.parallel.compare import run_reference

    _, train, rows = case.resolve()
    key = (case.model, case.layers, repr(train), rows, case.steps, case.evaluate)
    if key not in _references:
        _references[key] = run_reference(case.spec(), train, rows, case.steps, case.evaluate)
    return _references[key]


@dataclass(frozen=True)
class Tolerance:
    """How close a layout must come to the single process (relative for losses and norms, absolute
    for the updated parameters); None leaves a quantity unchecked."""

    loss_rel: float
    param_abs: float
    first_norm_rel: float | None = None  # step 0: same weights, only the summation order differs
    norm_rel: float | None = None  # every step
    eval_rel: float | None = None


def _close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * abs(want)


def assert_matches(case: Case, ranks: list[dict], tol: Tolerance, clipping: bool = False) -> Any:
    """Every rank reports the same losses; they, the gradient norms, the eval loss and the
    parameters (merged over the ranks that report them) match the single process within `tol`.
    With `clipping`, the reference's norms must all exceed the clip, so clipping is covered.
    Returns the fivefold.parallel.compare.Comparison."""
    from fivefold.parallel.compare import RunResult, compare

    ref = reference(case)
    if clipping:
        assert min(ref.grad_norms) > case.train.grad_clip, "clipping must be active for this test to cover it"
    params: dict[str, torch.Tensor] = {}
    for r in ranks:  # the loss is the global mean on every rank
        assert r["losses"] == ranks[0]["losses"]
        params.update(r["params"] or {})
    got = ranks[0]
    assert set(ref.params) <= set(params), set(ref.params) - set(params)  # (a tied head comes twice)
    assert len(got["losses"]) == len(ref.losses) == case.steps
    cmp = compare(ref, RunResult(got["losses"], got["grad_norms"], params), tol.loss_rel, tol.param_abs)
    print(
        f"{case.id}: loss rel {max(cmp.loss_rel):.2g}, params abs {cmp.max_abs:.2g}, {got['seconds']:.1f} s"
    )
    assert max(cmp.loss_rel) <= tol.loss_rel, (got["losses"], ref.losses)
    norms = list(zip(got["grad_norms"], ref.grad_norms))
    if tol.first_norm_rel is not None:
        assert _close(*norms[0], tol.first_norm_rel), norms[0]
    if tol.norm_rel is not None:
        assert all(_close(g, w, tol.norm_rel) for g, w in norms), norms
    if tol.eval_rel is not None:
        for r in ranks:
            assert _close(r["eval"], ref.eval_loss, tol.eval_rel), (r["eval"], ref.eval_loss)
    assert cmp.max_abs <= tol.param_abs, f"{cmp.worst_param}: {cmp.max_abs:.3g}"
    return cmp
