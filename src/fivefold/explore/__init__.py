"""`explore`: one self-contained HTML page to play with layouts, driven by the planner.

Views: the strategy picker (what each strategy cuts and what it costs for this model), the
layout lab (a factor per axis; every number is the planner's, precomputed for every layout the
search considers), the search's best layouts with its explanation, inference, a run directory
(loss and held-out loss, the measured ledger beside the plan, the measured timeline) and a
cheat sheet. The page has no external scripts, fonts or requests, so it opens from disk anywhere.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.errors import FivefoldError
from fivefold.explore.lab import lab_key, lab_table
from fivefold.explore.meshview import mesh_view
from fivefold.explore.run import read_run, trace_bars
from fivefold.explore.strategy import strategy_cards
from fivefold.explore.timeline import pipeline_picture
from fivefold.mesh import build_mesh, describe
from fivefold.plan import Plan, TrainShape, plan
from fivefold.plan.search import plan_flags, search
from fivefold.plan.text import count_words
from fivefold.plan.trainers import runtime_kernel

# the lab's pipeline pictures are replays (torch's schedule tables): embed those of up to
# PICTURE_ACTIONS stage×micro-batch×chunk actions each, smallest first, up to PICTURES_TOTAL in all
PICTURE_ACTIONS = 2048
PICTURES_TOTAL = 60_000

__all__ = ["build_page", "read_run", "runtime_kernel", "trace_bars"]


def layout_entry(label: str, result: Plan) -> dict[str, Any]:
    lay = result.layout
    entry = {
        "label": label,
        "flags": plan_flags(result),  # with its micro-batch and split: what `plan` and `train` take
        "key": lab_key(lay, result.shape.micro_batch),
        "plan": result.to_json(),
        "mesh": mesh_view(lay, result.gpus_per_node),
        "reading": describe(build_mesh(lay, result.gpus, result.gpus_per_node))
        if result.gpus <= 4096
        else "",
    }
    if lay.pp > 1:
        entry["pipeline"] = pipeline_picture(lay.pp_schedule, lay.pp, result.microbatches, lay.virtual_stages)
    return entry


def _inference_rows(
    model: ModelSpec, hw: HardwareSpec, gpus: int, gpn: int, context: int, width: int = 2
) -> list[dict]:
    """Serving layouts (tp inside a node × pp, the rest replicas) planned by `plan --mode inference`,
    weights and KV cache `width` bytes an element (the page's training dtype; the command says it)."""
    from fivefold.mesh import resolve_layout
    from fivefold.plan.inference import InferenceShape, inference_plan
    from fivefold.plan.runshape import dtype_name

    rows = []
    # as `plan --mode inference` plans it
    shape = InferenceShape(batch=8, context=context, prompt=context // 2, weight_bytes=width, kv_bytes=width)
    dtype = dtype_name(width)
    for tp in (1, 2, 4, 8, 16):
        for pp in (1, 2, 4, 8, 16):
            if tp > gpn or gpus % (tp * pp) or model.heads % tp:
                continue
            try:
                lay = resolve_layout(Layout(tp=tp, pp=pp, fsdp=gpus // (tp * pp), dp=1), gpus)
                p = inference_plan(model, hw, lay, shape, gpn).to_json()
            except FivefoldError:
                continue
            p["flags"] = (
                f"--mode inference --tp {tp} --pp {pp} --batch {shape.batch} --context {context} "
                f"--dtype {dtype}"
            )
            rows.append(p)
    return rows


def train_refuses(model: ModelSpec, layout: Layout, seq_len: int) -> str:
    """Why `fivefold train` refuses a layout (`check_trainable`), or "" when it runs it."""
    from fivefold.support import check_trainable

    try:
        check_trainable(model, layout, seq_len)
    except FivefoldError as exc:
        return str(exc)
    return ""


def build_page(
    model: ModelSpec,
    hw: HardwareSpec,
    gpus: int,
    shape: TrainShape,
    layout: Layout | None = None,
    gpus_per_node: int | None = None,
    run_dir: str | Path | None = None,
    top: int = 5,
    lab: bool = True,
    lab_also: list[tuple[HardwareSpec, int, int]] = (),  # type: ignore[assignment]
) -> str:
    """The HTML page as a string, of fivefold's runtime: each cluster's attention is the kernel torch's
    SDPA runs on its GPU, as `fivefold plan` (the command the page shows) plans it there."""
    gpn = gpus_per_node or hw.gpus_per_node
    shape = runtime_kernel(shape, hw.name)
    run, bars = read_run(run_dir) if run_dir else (None, [])
    layouts = []
    if layout is not None:  # a layout only other frameworks run is still drawn, and named as such
        refused = train_refuses(model, layout, shape.seq_len)
        label = f"your layout (fivefold train refuses it: {refused})" if refused else "your layout"
        layouts.append(layout_entry(label, plan(model, hw, layout, shape, gpn)))
    explanation: list[str] = []
    if top > 0:
        found = search(model, hw, gpus, shape, gpn, top=top)
        explanation = found.explanation
        for i, p in enumerate(found.plans):
            layouts.append(layout_entry(f"search #{i + 1}: {plan_flags(p)}", p))
    if not layouts:
        raise FivefoldError("nothing to show: give a layout or let the search run (--top > 0)")
    if bars:
        layouts[0]["trace"] = bars
    labs = []
    if lab:  # the page's own cluster first, then any others asked for
        labs.append(lab_table(model, hw, gpus, shape, gpn, [layout] if layout is not None else []))
        labs[0]["pictures"] = _pictures(labs[0].pop("pipelines"), layouts)
        for other_hw, other_gpus, other_gpn in lab_also:
            table = lab_table(model, other_hw, other_gpus, runtime_kernel(shape, other_hw.name), other_gpn)
            table["pictures"] = _pictures(table.pop("pipelines"), [])
            labs.append(table)
    data = {
        "title": f"{model.name} on {gpus} × {hw.name}",
        "subtitle": f"{count_words(model.num_params())} parameters · sequence {shape.seq_len} · global batch "
        f"{shape.global_batch} sequences · {gpn} GPUs per node",
        "model": {"name": model.name, "moe": model.is_moe, "experts": model.experts, "layers": model.layers},
        "cluster": {
            "hardware": hw.name,
            "gpus": gpus,
            "gpus_per_node": gpn,
            "seq_len": shape.seq_len,
            "global_batch": shape.global_batch,
        },
        "layouts": layouts,
        "explanation": explanation,
        "labs": labs,
        "strategies": strategy_cards(model, hw, shape.seq_len, gpn, shape),
        "inference": _inference_rows(model, hw, gpus, gpn, shape.seq_len, shape.param_bytes),
        "run": run,
    }
    template = (resources.files("fivefold.explore") / "page.html").read_text()
    # no '<' in the embedded JSON at all: '</script>' or '<!--' in a run's strings cannot end it early
    blob = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    return template.replace("/*FIVEFOLD_DATA*/", blob)


def _pictures(wanted: list[tuple[str, int, int, int]], layouts: list[dict[str, Any]]) -> dict[str, Any]:
    """Replayed pipeline pictures for the lab, keyed schedule.p.m.v, smallest first within a budget;
    the layouts' own pictures are always included."""
    out: dict[str, Any] = {}
    for entry in layouts:
        pic = entry.get("pipeline")
        if pic:
            out[f"{pic['schedule']}.{pic['p']}.{pic['m']}.{entry['plan']['layout']['virtual_stages']}"] = pic
    spent = 0
    for sched, p, m, v in sorted(wanted, key=lambda w: (w[1] * w[2] * w[3], w)):
        key = f"{sched}.{p}.{m}.{v}"
        size = p * m * v
        if key in out:
            continue
        if size > PICTURE_ACTIONS or spent + size > PICTURES_TOTAL:
            break
        spent += size
        pic = pipeline_picture(sched, p, m, v)
        if "error" in pic:
            continue
        pic.pop("ops", None)  # the lab draws the raster; op detail only for the listed layouts
        out[key] = pic
    return out
