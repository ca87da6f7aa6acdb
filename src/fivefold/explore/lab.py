"""The Layout lab's table: the planner's own result for every layout the search considers.

The page has no cost model of its own: for a model and cluster it carries `plan(...)` for each
layout `plan.search.candidates` yields, with every micro-batch size and recompute choice the
search tries, keyed by the lab's controls. A combination outside that set is named as such,
with the planner's own message where the planner rejects it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from fivefold.config import HardwareSpec, Layout, ModelSpec
from fivefold.errors import FivefoldError
from fivefold.explore.meshview import mesh_view
from fivefold.plan import Plan, TrainShape, plan
from fivefold.plan.search import RECOMPUTE_ORDER, candidates, lightest_recompute

MICRO_BATCHES = (1, 2, 4, 8)
# the lab's fourth recompute choice: full recompute of the fewest blocks per chunk that fit, as the
# search picks it (`--recompute full --recompute-layers N`), offered where selective does not fit
FEWEST = "full-fewest"
FACTORS = ("dp", "fsdp", "tp", "pp", "cp", "ep")
# (grads_apart, 0 or 1: the peak holds the larger of grads and activations, `Memory.grads_apart`)
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "total", "grads_apart")
SHOWN = 4  # significant digits on the page
ENTRY_FIELDS = (
    "fits",
    "microbatches",
    "step_time_s",
    "mfu",
    "bubble_fraction",
    "tokens_per_s",
    "memory",
    "stage",
    "comm",
    "recompute_layers",
)
NUMERIC_ROW_FIELDS = ("bytes", "wire_bytes", "time_s", "exposed_s")
ROW_FIELDS = ("axis", "op", "link", "bytes", "wire_bytes", "time_s", "exposed_s", "count", "group", "overlap")


def lab_key(layout: Layout, micro_batch: int) -> str:
    """The lab's controls as one string: factors and sequence parallelism (0/1), zero, recompute,
    schedule.v, micro-batch. sp is part of the key because a layout given without it (tp > 1, no
    `--sp`) plans differently from the search's own, which turns it on wherever tp > 1."""
    factors = ".".join(str(getattr(layout, a)) for a in FACTORS) + f".{int(layout.sp)}"
    sched = f"{layout.pp_schedule}.{layout.virtual_stages}" if layout.pp > 1 else "-.1"
    recompute = FEWEST if layout.recompute == "full" and layout.recompute_layers else layout.recompute
    return f"{factors}|{layout.zero}|{recompute}|{sched}|{micro_batch}"


def axes_key(layout: Layout) -> str:
    return ".".join(str(getattr(layout, a)) for a in FACTORS) + f"|{layout.order}"


class _Strings:
    def __init__(self) -> None:
        self.items: list[str] = []
        self.index: dict[str, int] = {}

    def add(self, text: str) -> int:
        if text not in self.index:
            self.index[text] = len(self.items)
            self.items.append(text)
        return self.index[text]


class _Rows:
    """Comm rows and strings are repeated across thousands of plans: store each once."""

    def __init__(self, words: _Strings) -> None:
        self.rows: list[list[Any]] = []
        self.index: dict[tuple, int] = {}
        self.words = words

    def add(self, row: dict[str, Any]) -> int:
        values = tuple(
            shown(row[f])
            if f in NUMERIC_ROW_FIELDS
            else self.words.add(row[f])
            if isinstance(row[f], str)
            else row[f]
            for f in ROW_FIELDS
        )
        if values not in self.index:
            self.index[values] = len(self.rows)
            self.rows.append(list(values))
        return self.index[values]


def shown(x: float) -> float:
    """A number to the SHOWN significant digits the page prints (keeps the page small)."""
    return float(f"{x:.{SHOWN}g}")


def compact(p: Plan, rows: _Rows) -> list[Any]:
    """The numbers the lab shows, as `plan --json` has them to the digits shown (ENTRY_FIELDS)."""
    j = p.to_json()
    return [
        int(j["fits"]),
        j["microbatches"],
        shown(j["step_time_s"]),
        shown(j["mfu"]),
        shown(j["bubble_fraction"]),
        shown(j["tokens_per_s"]),
        [int(shown(j["memory"][k])) for k in MEMORY_PARTS],
        j["memory"]["stage"],
        [rows.add(c) for c in j["comm"]],
        p.layout.recompute_layers,
    ]


def lab_table(
    model: ModelSpec,
    hw: HardwareSpec,
    gpus: int,
    shape: TrainShape,
    gpus_per_node: int,
    extra: list[Layout] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """Every considered layout × micro-batch × recompute, planned; plus their meshes by axes."""
    words = _Strings()  # rows' strings are indices into it
    rows = _Rows(words)
    entries: dict[str, dict[str, list[Any]]] = {}  # factors -> rest of the key -> entry
    rejected: dict[str, str] = {}
    meshes: dict[str, dict[str, Any]] = {}
    pipelines: set[tuple[str, int, int, int]] = set()
    usable = 0  # usable memory per GPU, as the plans report it
    bases = list(candidates(model, hw, gpus, shape, gpus_per_node)) + list(extra)
    for base in bases:
        # the lightest variant first: when it does not fit, no other does, and only it is kept
        # (the page says so) — most of a big cluster's candidates end here
        variants = [(MICRO_BATCHES[0], RECOMPUTE_ORDER[-1])] + [
            (b, rc) for b in MICRO_BATCHES for rc in RECOMPUTE_ORDER
        ]
        for i, (b, rc) in enumerate(variants):
            sh = dataclasses.replace(shape, micro_batch=b)
            lay = copy.copy(base)
            lay.recompute, lay.recompute_layers = rc, 0
            key = lab_key(lay, b)
            factors, rest = key.split("|", 1)
            if rest in entries.get(factors, {}) or key in rejected:
                continue
            try:
                p = plan(model, hw, lay, sh, gpus_per_node)
            except FivefoldError as exc:
                rejected[key] = str(exc)
                continue
            entries.setdefault(factors, {})[rest] = compact(p, rows)
            usable = usable or p.to_json()["memory_capacity"]
            if i == 0 and not p.fits:  # memory only grows with micro-batch and lighter recompute
                break
            if p.layout.pp > 1:
                pipelines.add((lay.pp_schedule, lay.pp, p.microbatches, lay.virtual_stages))
        for b in MICRO_BATCHES:
            sh = dataclasses.replace(shape, micro_batch=b)
            _add_fewest_blocks(model, hw, base, sh, gpus_per_node, entries, rows)
        if base.recompute_layers:  # a layout given with its own block count: shown as given
            key = lab_key(base, shape.micro_batch)
            try:
                p = plan(model, hw, base, shape, gpus_per_node)
            except FivefoldError as exc:
                rejected[key] = str(exc)
            else:
                factors, rest = key.split("|", 1)
                entries.setdefault(factors, {})[rest] = compact(p, rows)
        ak = axes_key(base)
        if ak not in meshes:
            view = mesh_view(base, gpus_per_node)
            meshes[ak] = [
                [d["name"], d["size"], d["link"], words.add(d["comm"]), d["parts"]] for d in view["dims"]
            ]
    return {
        "hardware": hw.name,
        "capacity": usable,
        "gpus": gpus,
        "gpus_per_node": gpus_per_node,
        "order": bases[0].order if bases else "",
        "memory_parts": list(MEMORY_PARTS),
        "row_fields": list(ROW_FIELDS),
        "rows": rows.rows,
        "entry_fields": list(ENTRY_FIELDS),
        "entries": entries,
        "rejected": _dedupe_messages(rejected),
        "meshes": meshes,
        "words": words.items,
        "pipelines": sorted(pipelines),
    }


def _add_fewest_blocks(
    model: ModelSpec,
    hw: HardwareSpec,
    base: Layout,
    shape: TrainShape,
    gpus_per_node: int,
    entries: dict[str, dict[str, list[Any]]],
    rows: _Rows,
) -> None:
    """Where selective recompute does not fit and full does, the search's middle way: full recompute
    of the fewest blocks per chunk that fit, under the key FEWEST (not added when that is all)."""

    def entry(recompute: str) -> list[Any] | None:
        lay = copy.copy(base)
        lay.recompute, lay.recompute_layers = recompute, 0
        factors, rest = lab_key(lay, shape.micro_batch).split("|", 1)
        return entries.get(factors, {}).get(rest)

    selective, full = entry("selective"), entry("full")
    if selective is None or full is None or selective[0] or not full[0]:
        return

    tried: dict[int, Plan] = {}  # block count -> its plan (the bisection's last one is the entry)

    def fits(layout: Layout) -> bool:  # full on every block fits: the lab's own entry says so
        if not layout.recompute_layers:
            return True
        tried[layout.recompute_layers] = plan(model, hw, layout, shape, gpus_per_node)
        return tried[layout.recompute_layers].fits

    some = lightest_recompute(base, model, fits, ("full",), shape.seq_len)
    if some is None or not some.recompute_layers:
        return
    factors, rest = lab_key(some, shape.micro_batch).split("|", 1)
    entries[factors][rest] = compact(tried[some.recompute_layers], rows)


def _dedupe_messages(rejected: dict[str, str]) -> dict[str, Any]:
    texts: list[str] = []
    index: dict[str, int] = {}
    keys: dict[str, int] = {}
    for key, text in rejected.items():
        if text not in index:
            index[text] = len(texts)
            texts.append(text)
        keys[key] = index[text]
    return {"texts": texts, "keys": keys}
