"""The device mesh in pure Python: which ranks talk to which, and over which link.

A layout's five world axes (dp, fsdp, cp, tp, pp) are laid out on the ranks in `order`,
innermost first: the first axis in `order` has stride 1 (adjacent ranks), the next one a
stride of the first one's size, and so on. Ranks `0..gpus_per_node-1` are node 0.

Besides the five world axes, `build_mesh` names the derived dims the runtime needs:

* `ep`          expert parallel, folded onto the fsdp×cp ranks (it multiplies nothing): the
                fsdp×cp block is flattened innermost-first and its `ep` innermost ranks form
                one expert group, so an expert's all-to-all stays on the closest ranks.
* `expert_fsdp` what is left of fsdp×cp for the experts' own FSDP shard (size fsdp·cp/ep).
* `fsdp_cp`     fsdp×cp flattened: FSDP shards the weights over it, because CP ranks hold the
                same weights (as TorchTitan does).
* `batch`       dp×fsdp flattened: ranks that see different data; the data loader splits by it.
* `dp_fsdp_cp`  dp×fsdp×cp flattened: every rank holding the same weights; loss and gradient
                norm reductions run over it.

A flattened dim's index follows the DeviceMesh convention (its innermost constituent varies
fastest), so each group lists its ranks in index order, which is also ascending rank order.
No torch import here: plan, mesh and explore stay fast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from fivefold.config import AXES, Layout, ModelSpec, complete_order
from fivefold.config.layout import MAX_GPUS
from fivefold.errors import FivefoldError, divisors

DERIVED_DIMS = ("ep", "expert_fsdp", "fsdp_cp", "batch", "dp_fsdp_cp")
# flattened dims and the world axes they combine
FLATTENED: dict[str, tuple[str, ...]] = {
    "fsdp_cp": ("fsdp", "cp"),
    "batch": ("dp", "fsdp"),
    "dp_fsdp_cp": ("dp", "fsdp", "cp"),
}
LINK_WORDS = {"intra": "intra-node", "inter": "inter-node", "mixed": "mixed", "none": "—"}


@dataclass
class Dim:
    """One mesh dim: its groups of ranks, each group's link kind, and the collective(s) it runs."""

    name: str
    size: int
    groups: list[list[int]]
    links: list[str]  # per group: "intra" | "inter" | "mixed"
    comm: str  # human words of its collective(s)
    link: str = "none"  # summary over groups: intra | inter | mixed | none (size 1)
    ops: list[str] = field(default_factory=list)  # the same collectives by the ledger's names

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "size": self.size,
            "groups": self.groups,
            "links": self.links,
            "link": self.link,
            "comm": self.comm,
            "ops": self.ops,
        }


@dataclass
class RankInfo:
    rank: int
    node: int
    local_rank: int
    coords: dict[str, int] = field(default_factory=dict)


@dataclass
class MeshInfo:
    world: int
    gpus_per_node: int
    layout: Layout  # resolved
    dims: dict[str, Dim]
    ranks: list[RankInfo]

    def group_of(self, rank: int, dim: str) -> list[int]:
        """The group of `dim` that holds `rank`."""
        if dim not in self.dims:
            raise FivefoldError(f"unknown mesh dim {dim!r}; dims: {', '.join(self.dims)}")
        if not 0 <= rank < self.world:
            raise FivefoldError(f"rank {rank} is outside the world of {self.world}")
        for group in self.dims[dim].groups:
            if rank in group:
                return group
        raise AssertionError(f"rank {rank} in no group of {dim}")  # groups partition the world

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.gpus_per_node)

    def to_json(self) -> dict:
        """The contract object of `fivefold mesh --json`."""
        return {
            "world": self.world,
            "gpus_per_node": self.gpus_per_node,
            "order": self.layout.order_list,
            "layout": {a: getattr(self.layout, a) for a in AXES + ("ep",)},
            "dims": [d.to_json() for d in self.dims.values()],
            "ranks": [
                {"rank": r.rank, "node": r.node, "local_rank": r.local_rank, "coords": r.coords}
                for r in self.ranks
            ],
        }


# --------------------------------------------------------------------------------------------
# arithmetic shared by the fast and the full path


def strides(layout: Layout) -> dict[str, int]:
    """Rank stride of each world axis: the innermost axis of `order` has stride 1."""
    out: dict[str, int] = {}
    step = 1
    for axis in layout.order_list:
        out[axis] = step
        step *= getattr(layout, axis)
    return out


def link_kind(ranks: list[int], gpus_per_node: int) -> str:
    """intra: one node; inter: every rank on its own node; mixed: some share a node, some not."""
    nodes = {r // gpus_per_node for r in ranks}
    if len(nodes) == 1:
        return "intra"
    return "inter" if len(nodes) == len(ranks) else "mixed"


def summarize_links(links: list[str], size: int) -> str:
    if size == 1:
        return "none"
    kinds = set(links)
    return kinds.pop() if len(kinds) == 1 else "mixed"


def axis_link_kinds(layout: Layout, gpus_per_node: int) -> dict[str, str]:
    """Link kind ("intra" | "inter" | "mixed") of every world axis of size > 1, by arithmetic.

    An axis of stride s and size n has groups {b, b+s, ..., b+(n-1)s}. If s·n divides the node
    size, every group sits in one aligned block inside a node (intra). If s ≥ the node size,
    consecutive members are at least one node apart (inter). Anything else (non-dividing sizes)
    falls back to checking the groups, which only odd layouts reach. `layout` must be resolved.
    """
    world = layout.world
    out: dict[str, str] = {}
    for axis, stride in strides(layout).items():
        size = getattr(layout, axis)
        if size == 1:
            continue
        if world <= gpus_per_node or gpus_per_node % (stride * size) == 0:
            out[axis] = "intra"
        elif stride >= gpus_per_node:
            out[axis] = "inter"
        else:
            links = [link_kind(g, gpus_per_node) for g in _axis_groups(world, stride, size)]
            out[axis] = summarize_links(links, size)
    return out


def _axis_groups(world: int, stride: int, size: int) -> list[list[int]]:
    """Groups of an axis with this stride and size: ranks that differ only in its coordinate."""
    block = stride * size
    return [
        [outer + inner + i * stride for i in range(size)]
        for outer in range(0, world, block)
        for inner in range(stride)
    ]


# --------------------------------------------------------------------------------------------
# the full mesh


def comm_words(name: str, layout: Layout) -> str:
    """What the dim's collectives are, in words (docs/mesh.md)."""
    if name == "dp":
        if layout.fsdp > 1:  # HSDP: FSDP shards inside a replica, DP all-reduces across
            return "all-reduce (grads, across replicas)"
        if layout.zero == 1:  # torch's ZeroRedundancyOptimizer: whole gradients, each shard's owner sends
            return "all-reduce (grads) + broadcast (params)"
        return "all-reduce (grads)"
    return {
        "fsdp": "all-gather (params) + reduce-scatter (grads)",
        "tp": "all-gather + reduce-scatter (activations, SP)" if layout.sp else "all-reduce (activations)",
        "pp": "send/recv (activations)",
        "cp": {
            "ring": "send/recv (K/V ring)",
            "allgather": "all-gather (K/V) + reduce-scatter (their grads)",
            "ulysses": "all-to-all (sequence <-> heads)",
        }[layout.cp_impl],
        "ep": "all-to-all (tokens, there and back)",
        "expert_fsdp": "all-gather + reduce-scatter (expert params/grads)",
        "fsdp_cp": "all-gather (params) + reduce-scatter (grads)",
        "batch": "none (data loader split)",
        "dp_fsdp_cp": "all-reduce (loss, grad norm)",
    }[name]


# the ledger's names (fivefold.measure.ledger) of the collectives `comm_words` describes
OP_WORDS = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "broadcast": "broadcast",
    "all-to-all": "all_to_all",
    "send/recv": "send, recv",
}


def comm_ops(name: str, layout: Layout) -> list[str]:
    """The dim's collectives by the names the ledger, plan and verify give them (`all_reduce`, ...)."""
    words = comm_words(name, layout)
    ops = []
    for part in words.split(" + "):
        head = part.split(" (")[0]
        ops += [op for op in OP_WORDS.get(head, "").split(", ") if op]
    return ops


def resolve_layout(
    layout: Layout,
    world: int,
    gpus_per_node: int | None = None,
    model: ModelSpec | None = None,
    seq_len: int | None = None,
) -> Layout:
    """`Layout.resolve` (and, given a model, its shape checks), with the nearest valid layouts added to
    an error's message: layouts this same check accepts, with tensor parallel inside a node."""
    if world <= 0:
        raise FivefoldError(f"--gpus must be positive, got {world}")
    complete_order(layout.order)  # a bad --order is not cured by other factors: no suggestions
    if model is not None:
        layout.check_experts(model)

    def check(lay: Layout) -> Layout:
        lay = lay.resolve(world)
        if model is not None:
            lay.check_model(model, seq_len)
        return lay

    try:
        return check(layout)
    except FivefoldError as exc:
        near = nearest_layouts(layout, world, gpus_per_node=gpus_per_node, accept=check)
        if not near:
            raise
        raise FivefoldError(f"{exc}; nearest valid layouts: {' | '.join(near)}") from None


def _flags(values: dict[str, int]) -> str:
    shown = [f"--{a} {v}" for a, v in values.items() if v != 1]
    return " ".join(shown) or "(all 1)"


def nearest_layouts(
    layout: Layout,
    world: int,
    limit: int = 4,
    gpus_per_node: int | None = None,
    accept: Callable[[Layout], object] | None = None,
) -> list[str]:
    """Valid layouts of `world` closest to `layout`: one model-splitting axis (tp, pp, cp) moved to a
    divisor of the world, or one data axis filling it, or ep re-fitted; every one passes `accept` (a
    check that raises FivefoldError) and keeps tp within a node. Ranked by how far the factors moved."""
    base = {a: getattr(layout, a) for a in AXES + ("ep",)}
    if any(v == 0 or v < -1 for v in base.values()):
        return []
    fixed = {a: (1 if v == -1 else v) for a, v in base.items()}
    data_axis = "fsdp" if base["fsdp"] != 1 and base["dp"] == 1 else "dp"
    trials: list[dict[str, int]] = []
    for axis in AXES:  # one axis takes whatever the others leave
        rest = math.prod(fixed[a] for a in AXES if a != axis)
        if world % rest == 0:
            trials.append(dict(fixed, **{axis: world // rest}))
    for axis in ("tp", "pp", "cp"):  # a model axis moves, the data axis fills the rest
        for d in divisors(world):
            rest = d * math.prod(fixed[a] for a in AXES if a not in (axis, data_axis))
            if world % rest == 0:
                trials.append(dict(fixed, **{axis: d, data_axis: world // rest}))
    # the data ranks move between dp and fsdp (a ZeRO stage that needs the other kind of data axis)
    data = fixed["dp"] * fixed["fsdp"]
    trials += [dict(fixed, dp=data, fsdp=1), dict(fixed, dp=1, fsdp=data)]
    scored: list[tuple[float, str]] = []
    for trial in trials:
        room = trial["fsdp"] * trial["cp"]
        if room % trial["ep"]:
            trial["ep"] = max(d for d in divisors(room) if d <= trial["ep"])
        if trial == fixed or (gpus_per_node and trial["tp"] > gpus_per_node):
            continue
        candidate = Layout(**{**layout.__dict__, **trial})
        if accept is not None:
            try:
                accept(candidate)
            except FivefoldError:
                continue
        else:
            try:
                candidate.resolve(world)
            except FivefoldError:
                continue
        # dp and fsdp are one pool of data ranks: re-labelling them moves less than re-purposing them
        model_moves = sum(abs(math.log2(trial[a] / fixed[a])) for a in trial if a not in ("dp", "fsdp"))
        data_moves = abs(math.log2(trial["dp"] * trial["fsdp"] / data))
        relabelled = 0.5 if (trial["dp"], trial["fsdp"]) != (fixed["dp"], fixed["fsdp"]) else 0.0
        distance = model_moves + data_moves + relabelled
        scored.append((distance, _flags(trial)))
    out: list[str] = []
    for _, text in sorted(scored):
        if text not in out:
            out.append(text)
    return out[:limit]


def build_mesh(layout: Layout, world: int, gpus_per_node: int) -> MeshInfo:
    """Every rank's coordinates and every dim's groups and links (resolves -1, validates)."""
    if not 0 < gpus_per_node <= MAX_GPUS:
        raise FivefoldError(f"--gpus-per-node must be in 1..{MAX_GPUS:,}, got {gpus_per_node:.3g}")
    lay = resolve_layout(layout, world, gpus_per_node)
    stride = strides(lay)
    order = lay.order_list
    sizes = {a: getattr(lay, a) for a in AXES}

    ranks: list[RankInfo] = []
    for rank in range(world):
        coords = {a: (rank // stride[a]) % sizes[a] for a in AXES}
        for name, parts in FLATTENED.items():
            coords[name] = _flat_index(coords, parts, sizes, order)
        coords["ep"] = coords["fsdp_cp"] % lay.ep
        coords["expert_fsdp"] = coords["fsdp_cp"] // lay.ep
        ranks.append(RankInfo(rank, rank // gpus_per_node, rank % gpus_per_node, coords))

    dim_sizes = dict(
        sizes,
        ep=lay.ep,
        expert_fsdp=lay.fsdp * lay.cp // lay.ep,
        fsdp_cp=lay.fsdp * lay.cp,
        batch=lay.dp * lay.fsdp,
        dp_fsdp_cp=lay.dp * lay.fsdp * lay.cp,
    )
    dims: dict[str, Dim] = {}
    for name in list(AXES) + list(DERIVED_DIMS):
        groups = _groups_of(ranks, name)
        links = [link_kind(g, gpus_per_node) for g in groups]
        size = dim_sizes[name]
        assert all(len(g) == size for g in groups)
        dims[name] = Dim(
            name,
            size,
            groups,
            links,
            comm_words(name, lay) if size > 1 else "—",
            summarize_links(links, size),
            comm_ops(name, lay) if size > 1 else [],
        )
    return MeshInfo(world, gpus_per_node, lay, dims, ranks)


def _flat_index(
    coords: dict[str, int], parts: tuple[str, ...], sizes: dict[str, int], order: list[str]
) -> int:
    """Index in a flattened dim: the constituent innermost in `order` varies fastest."""
    index, scale = 0, 1
    for axis in sorted(parts, key=order.index):
        index += coords[axis] * scale
        scale *= sizes[axis]
    return index


def _groups_of(ranks: list[RankInfo], name: str) -> list[list[int]]:
    """Group ranks that agree on every world coordinate outside `name`, ordered by `name`'s index."""
    folded = {"ep": ("fsdp", "cp"), "expert_fsdp": ("fsdp", "cp")}
    varying = folded.get(name) or FLATTENED.get(name) or (name,)
    buckets: dict[tuple, list[tuple[int, int]]] = {}
    for r in ranks:
        key = tuple(r.coords[a] for a in AXES if a not in varying)
        if name == "ep":
            key += (r.coords["expert_fsdp"],)
        elif name == "expert_fsdp":
            key += (r.coords["ep"],)
        buckets.setdefault(key, []).append((r.coords[name], r.rank))
    groups = [[rank for _, rank in sorted(members)] for members in buckets.values()]
    return sorted(groups, key=lambda g: g[0])


def describe(info: MeshInfo) -> str:
    """A one-paragraph reading of the layout in words."""
    lay, d = info.layout, info.dims
    words = LINK_WORDS
    parts: list[str] = []
    if lay.dp > 1 and lay.fsdp > 1:
        parts.append(
            f"This is HSDP: FSDP shards the model over groups of {lay.fsdp} ({words[d['fsdp'].link]}) and DP "
            f"replicates it {lay.dp} times ({words[d['dp'].link]}), so the heavy all-gather/reduce-scatter "
            f"traffic stays on the {d['fsdp'].link} link and the replicas only all-reduce gradients once "
            "a step."
        )
    elif lay.fsdp > 1:
        parts.append(
            f"This is FSDP over {lay.fsdp} ranks ({words[d['fsdp'].link]}): params, grads and "
            "optimizer state are sharded and gathered layer by layer."
        )
    elif lay.dp > 1:
        sync = "gradients are all-reduced once a step"
        if lay.zero == 1:
            sync = (
                "gradients are reduce-scattered onto the optimizer shards and the updated params "
                "all-gathered once a step (ZeRO-1)"
            )
        parts.append(
            f"This is data parallel over {lay.dp} replicas ({words[d['dp'].link]}): each holds the "
            f"whole model; {sync}."
        )
    else:
        parts.append("There is no data parallelism: every rank sees the same batch.")
    if lay.tp > 1:
        where = {
            "intra": "within a node, on the fast link as it should be",
            "inter": "across nodes — chatty per-layer traffic on the slow link",
            "mixed": "partly across nodes — some groups pay the slow link every layer",
        }[d["tp"].link]
        sp = " with sequence parallelism" if lay.sp else ""
        parts.append(f"Tensor parallel{sp} splits each layer over {lay.tp} GPUs {where}.")
    if lay.cp > 1:
        parts.append(
            f"Context parallel splits the sequence over {lay.cp} ranks ({words[d['cp'].link]}, "
            f"{lay.cp_impl}); FSDP shards weights over fsdp×cp = {lay.fsdp * lay.cp}."
        )
    if lay.pp > 1:
        parts.append(
            f"The layers are cut into {lay.pp} pipeline stages ({words[d['pp'].link]}), "
            f"passing activations point to point ({lay.pp_schedule})."
        )
    if lay.ep > 1:
        rest = d["expert_fsdp"].size
        sharded = (
            f"each expert is FSDP-sharded over the remaining {rest}"
            if rest > 1
            else "each rank holds its experts whole (ep takes every fsdp×cp rank)"
        )
        parts.append(
            f"Experts are split {lay.ep} ways ({words[d['ep'].link]} all-to-all) over the fsdp×cp "
            f"ranks; {sharded}."
        )
    parts.append(
        f"{info.world} GPUs on {info.nodes} node{'' if info.nodes == 1 else 's'} of {info.gpus_per_node}; "
        f"order {','.join(lay.order_list)} (innermost first)."
    )
    return " ".join(parts)
