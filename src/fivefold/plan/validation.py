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

from fivefold.config import HardwareSpec, Layout, ModelSpec, load_hardware
from fivefold.errors import FivefoldError
from fivefold.plan.memory import model_state
from fivefold.plan.report import plan
from fivefold.plan.result import Plan
from fivefold.plan.spec import TrainShape

GIB = 2**30
GPU_PRESETS = {"A100": "a100-80gb", "H100": "h100-80gb", "H800": "h100-80gb", "H200": "h200", "B200": "b200"}
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


def _hardware(run: dict[str, Any]) -> HardwareSpec:
    """The run's GPU: the matching preset with the run's published numbers laid over it, or, for a GPU
    without a preset, a spec from the run alone (the planner's default knobs)."""
    table = run.get("hardware", {})
    gpu = str(table.get("gpu", ""))
    preset = next((p for k, p in GPU_PRESETS.items() if k in gpu.upper()), None)
    changes: dict[str, Any] = {}
    for key, field_name, kind in (
        ("peak_bf16_tflops", "peak_tflops", float),
        ("gpu_memory_gb", "gpu_memory_gb", float),
        ("gpus_per_node", "gpus_per_node", int),
        ("inter_node_gbs_per_gpu", "inter_node_gbps", float),
        ("intra_node_gbs_per_gpu", "intra_node_gbps", float),
        ("hbm_gbs", "hbm_gbps", float),
    ):
        if key in table:
            changes[field_name] = kind(table[key])
    if preset is None:
        if "peak_tflops" not in changes or "gpu_memory_gb" not in changes:
            raise FivefoldError(
                f"run {run.get('id')}: GPU {gpu!r} has no preset and no published peak/memory"
            )
        return HardwareSpec(name=gpu or "gpu", **changes).validate()
    return dataclasses.replace(load_hardware(preset), **changes)


def build(run: dict[str, Any]) -> tuple[ModelSpec, Any, Layout, TrainShape] | None:
    """The planner's inputs for a run, or None for a memory-only example without a model shape."""
    mt, lt = run.get("model", {}), run.get("layout", {})
    if "layers" not in mt:
        return None
    shape_keys = (
        "layers",
        "hidden",
        "heads",
        "vocab",
        "ffn_hidden",
        "kv_heads",
        "head_dim",
        "experts",
        "experts_per_token",
        "expert_ffn_hidden",
        "shared_experts",
        "moe_layers",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "v_head_dim",
    )
    model = ModelSpec(name=run["id"], **{k: int(mt[k]) for k in shape_keys if k in mt}).validate()
    schedule = SCHEDULES.get(str(lt.get("pipeline_schedule", "1f1b")).lower(), "1f1b")
    v = int(lt.get("virtual_stages", 1))
    if lt.get("pp", 1) > 1 and v > 1 and schedule == "1f1b":
        schedule = "interleaved-1f1b"
    zero = int(lt.get("zero_stage", 0))
    dp, fsdp = lt.get("dp", -1 if "fsdp" not in lt else 1), lt.get("fsdp", 1)
    ep, cp = lt.get("ep", 1), lt.get("cp", 1)
    if ep > 1 and (fsdp * cp) % ep:  # experts fold onto sharded data ranks in fivefold's vocabulary
        dp, fsdp, zero = 1, -1 if dp == -1 else dp, max(zero, 2)
    layout = Layout(
        dp=dp,
        fsdp=fsdp,
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
    seq = int(mt.get("seq_len") or lt.get("seq_len"))
    batch = lt.get("global_batch") or int(lt["global_batch_tokens"]) // seq
    shape = TrainShape(seq_len=seq, global_batch=int(batch), micro_batch=int(lt.get("micro_batch", 1)))
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
    # a source that counts only the causal half of attention is compared with our causal-half numbers
    definition = str(run.get("flops_definition", "")).lower()
    causal = "causal" in definition and "non-causal" not in definition
    mfu = p.mfu_causal if causal else p.mfu
    if "iteration_time_s" in meas:
        out.append(Comparison(rid, "step time s", meas["iteration_time_s"], p.step_time_s))
    if "tokens_per_s" in meas:
        out.append(Comparison(rid, "tokens/s", meas["tokens_per_s"], p.tokens_per_s))
    if "tflops_per_gpu" in meas:
        basis = meas.get("tflops_basis", "model")
        pred = p.hardware_tflops_per_gpu if basis == "hardware" else mfu * hw.peak_tflops
        out.append(Comparison(rid, f"TFLOP/s ({basis})", meas["tflops_per_gpu"], pred))
    if "mfu" in meas:
        out.append(Comparison(rid, "MFU", meas["mfu"], mfu))
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


def validate(path: str | Path, skipped: list[str] | None = None) -> list[Comparison]:
    """Comparisons for every run; runs fivefold cannot express are listed in `skipped` with the reason."""
    rows: list[Comparison] = []
    for run in load_runs(path):
        try:
            rows.extend(compare(run)[1])
        except (FivefoldError, KeyError, TypeError, ValueError) as exc:
            if skipped is None:
                raise
            skipped.append(f"{run.get('id')}: {exc}")
    return rows


def table(rows: list[Comparison]) -> str:
    lines = [f"{'run':<44}{'metric':<20}{'published':>11}{'predicted':>11}{'error':>9}"]
    for r in rows:
        lines.append(f"{r.run:<44}{r.metric:<20}{r.published:>11.4g}{r.predicted:>11.4g}{r.error:>+9.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    default = Path(__file__).resolve().parents[4] / "shared" / "reference" / "published_runs.toml"
    missed: list[str] = []
    print(table(validate(sys.argv[1] if len(sys.argv) > 1 else default, missed)))
    for line in missed:
        print(f"skipped {line}")
