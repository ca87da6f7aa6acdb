"""Predicted vs published: runs the planner on every run of a `fivefold-reference-runs` TOML file.

Each run's model, hardware and layout are read as published (see the file's header); nothing is
fitted per run. Metrics compared when the run publishes them: iteration time, TFLOP/s per GPU (model
or hardware basis as published), MFU, HFU, model-state and activation memory.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fivefold.config import Layout, ModelSpec, load_hardware
from fivefold.plan.memory import model_state
from fivefold.plan.report import plan
from fivefold.plan.result import Plan
from fivefold.plan.spec import TrainShape

GIB = 2**30
GPU_PRESETS = {"A100": "a100-80gb", "H100": "h100-80gb", "H200": "h200", "B200": "b200"}
SCHEDULES = {
    "1f1b": "1f1b",
    "interleaved-1f1b": "interleaved-1f1b",
    "gpipe": "gpipe",
    "zero-bubble": "zero-bubble",
    "zbv": "zbv",
    "dualpipev": "dualpipev",
}


@dataclass
class Comparison:
    run: str
    metric: str
    published: float
    predicted: float

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    return tomllib.loads(Path(path).read_text()).get("run", [])


def _hardware(run: dict[str, Any]):
    hw_table = run.get("hardware", {})
    gpu = hw_table.get("gpu", "")
    preset = next((p for k, p in GPU_PRESETS.items() if k in gpu), "a100-80gb")
    hw = load_hardware(preset)
    changes: dict[str, Any] = {}
    if "peak_bf16_tflops" in hw_table:
        changes["peak_tflops"] = float(hw_table["peak_bf16_tflops"])
    if "gpu_memory_gb" in hw_table:
        changes["gpu_memory_gb"] = float(hw_table["gpu_memory_gb"])
    if "gpus_per_node" in hw_table:
        changes["gpus_per_node"] = int(hw_table["gpus_per_node"])
    if "inter_node_gbs_per_gpu" in hw_table:
        changes["inter_node_gbps"] = float(hw_table["inter_node_gbs_per_gpu"])
    return dataclasses.replace(hw, **changes)


def build(run: dict[str, Any]) -> tuple[ModelSpec, Any, Layout, TrainShape] | None:
    """The planner's inputs for a run, or None for a memory-only example without a model shape."""
    mt, lt = run.get("model", {}), run.get("layout", {})
    if "layers" not in mt:
        return None
    model = ModelSpec(
        layers=mt["layers"],
        hidden=mt["hidden"],
        heads=mt["heads"],
        vocab=mt["vocab"],
        ffn_hidden=mt.get("ffn_hidden", 0),
        kv_heads=mt.get("kv_heads", 0),
        name=run["id"],
    ).validate()
    schedule = SCHEDULES.get(str(lt.get("pipeline_schedule", "1f1b")).lower(), "1f1b")
    v = int(lt.get("virtual_stages", 1))
    if lt.get("pp", 1) > 1 and v > 1 and schedule == "1f1b":
        schedule = "interleaved-1f1b"
    zero = int(lt.get("zero_stage", 0))
    layout = Layout(
        dp=lt.get("dp", 1),
        fsdp=lt.get("fsdp", 1),
        tp=lt.get("tp", 1),
        pp=lt.get("pp", 1),
        cp=lt.get("cp", 1),
        ep=lt.get("ep", 1),
        zero=zero,
        sp=bool(lt.get("sequence_parallel")),
        pp_schedule=schedule,
        virtual_stages=v if lt.get("pp", 1) > 1 else 1,
        recompute=lt.get("recompute", "none"),
    ).resolve(lt.get("gpus"))
    seq = mt.get("seq_len") or lt.get("seq_len")
    shape = TrainShape(
        seq_len=int(seq), global_batch=int(lt["global_batch"]), micro_batch=int(lt.get("micro_batch", 1))
    )
    return model, _hardware(run), layout, shape


def compare(run: dict[str, Any]) -> tuple[Plan | None, list[Comparison]]:
    meas = run.get("measured", {})
    rid = run["id"]
    out: list[Comparison] = []
    inputs = build(run)
    if inputs is None:  # the ZeRO paper's per-device model state (fp16 weights and gradients)
        lt = run["layout"]
        psi = run["model"]["params_b"] * 1e9
        shape = TrainShape(
            seq_len=1,
            global_batch=1,
            grad_bytes=2,
            optimizer_bytes=int(lt.get("optimizer_bytes_per_param", 12)),
        )
        n = lt.get("dp", 1)
        state = sum(model_state(psi, 0.0, int(lt.get("zero_stage", 0)), n, n, shape))
        if "model_state_memory_gb_per_gpu" in meas:
            out.append(Comparison(rid, "model state GB", meas["model_state_memory_gb_per_gpu"], state / 1e9))
        return None, out
    model, hw, layout, shape = inputs
    p = plan(model, hw, layout, shape)
    if "iteration_time_s" in meas:
        out.append(Comparison(rid, "step time s", meas["iteration_time_s"], p.step_time_s))
    if "tflops_per_gpu" in meas:
        basis = meas.get("tflops_basis", "model")
        pred = p.hardware_tflops_per_gpu if basis == "hardware" else p.tflops_per_gpu
        out.append(Comparison(rid, f"TFLOP/s ({basis})", meas["tflops_per_gpu"], pred))
    if "mfu" in meas:
        out.append(Comparison(rid, "MFU", meas["mfu"], p.mfu))
    if "hfu" in meas:
        out.append(Comparison(rid, "HFU", meas["hfu"], p.hfu))
    if "analytic_param_optimizer_memory_gib_per_gpu" in meas:
        m = p.memory
        out.append(
            Comparison(
                rid,
                "model state GiB",
                meas["analytic_param_optimizer_memory_gib_per_gpu"],
                (m.params + m.grads + m.optimizer) / GIB,
            )
        )
    if "analytic_activation_memory_gib_per_gpu" in meas:
        out.append(
            Comparison(
                rid,
                "activations GiB",
                meas["analytic_activation_memory_gib_per_gpu"],
                p.memory.activations / GIB,
            )
        )
    for key, name in (("layer_forward_ms", "forward"), ("layer_backward_ms", "backward")):
        if key in meas:  # Korthikanti Table 4: one transformer layer, collectives and recompute included
            out.append(Comparison(rid, f"layer {name} ms", meas[key], 1e3 * p.stage_times[f"layer_{name}_s"]))
    if "fig7_activation_pct_of_tp_baseline" in meas:  # Korthikanti Figure 7: vs tp only, no recompute
        base = plan(model, hw, dataclasses.replace(layout, sp=False, recompute="none"), shape)
        pct = 100 * p.memory.activations / base.memory.activations
        out.append(Comparison(rid, "activations % of base", meas["fig7_activation_pct_of_tp_baseline"], pct))
    return p, out


def validate(path: str | Path) -> list[Comparison]:
    rows: list[Comparison] = []
    for run in load_runs(path):
        rows.extend(compare(run)[1])
    return rows


def table(rows: list[Comparison]) -> str:
    lines = [f"{'run':<44}{'metric':<20}{'published':>11}{'predicted':>11}{'error':>9}"]
    for r in rows:
        lines.append(f"{r.run:<44}{r.metric:<20}{r.published:>11.4g}{r.predicted:>11.4g}{r.error:>+9.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    default = Path(__file__).resolve().parents[4] / "shared" / "reference" / "published_runs.toml"
    print(table(validate(sys.argv[1] if len(sys.argv) > 1 else default)))
