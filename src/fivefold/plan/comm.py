"""Collective costs: bytes on the wire per rank and time, from a latency + bandwidth model per link.

Ring algorithms (Patarasuk & Yuan 2009; the ring all-reduce bound in docs/planner.md): for a payload of B
bytes over n ranks, an all-reduce sends 2(n-1)/n·B per rank in 2(n-1) steps; all-gather and
reduce-scatter send (n-1)/n·B in n-1 steps (B is the full, gathered size); an all-to-all sends
(n-1)/n·B; a point-to-point send is B in one step. Time = steps·α + wire / (β·link_efficiency),
with α and β those of the slowest link in the group (intra-node NVLink or the inter-node network); a
ring with k members a node takes the network's α on one step in k and NVLink's on the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from fivefold.config import HardwareSpec, Layout
from fivefold.layout_math import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BROADCAST,
    RECV,
    REDUCE_SCATTER,
    SEND,
    replica_axis,
)
from fivefold.mesh import axis_link_kinds, strides

DEFAULT_LINK_EFFICIENCY = 0.75  # share of the per-direction link bandwidth a large collective reaches


@dataclass
class Collective:
    """One kind of collective on one axis, summed over a training step (per rank)."""

    axis: str
    op: str
    bytes: float  # payload per step: the tensor sizes handed to the collective, summed
    wire_bytes: float  # what this rank sends on the wire per step
    time_s: float
    link: str
    count: int
    group: int
    exposed_s: float = 0.0  # the part not hidden behind compute
    overlap: str = "none"  # what it overlaps with, in words
    note: str = field(default="")

    def to_json(self) -> dict[str, object]:
        return {
            "axis": self.axis,
            "op": self.op,
            "bytes": int(self.bytes),
            "wire_bytes": int(self.wire_bytes),
            "time_s": self.time_s,
            "exposed_s": self.exposed_s,
            "link": self.link,
            "count": self.count,
            "group": self.group,
            "overlap": self.overlap,
        }


def wire_factor(op: str, n: int) -> tuple[float, int]:
    """(bytes sent per rank per payload byte, latency steps) of a ring collective over n ranks.

    `op` is one of the ledger's names (fivefold.layout_math); the older hyphenated spellings
    ("all-reduce", "send-recv") are accepted too.
    """
    op = op.replace("-", "_")
    if n <= 1:
        return 0.0, 0
    if op == ALL_REDUCE:
        return 2 * (n - 1) / n, 2 * (n - 1)
    if op in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
        return (n - 1) / n, n - 1
    if op in (SEND, RECV, "send_recv"):
        return 1.0, 1
    if op == BROADCAST:  # pipelined down a ring: every rank but the last forwards the whole payload
        return 1.0, n - 1
    raise ValueError(op)


def link_params(hw: HardwareSpec, link: str, per_node: int = 1) -> tuple[float, float]:
    """(latency in s, bandwidth in bytes/s) of a link kind; a group spanning nodes runs at the network's.

    A group with `per_node` members on each node ("mixed") stripes its rings over that many NICs
    (NCCL runs one ring per NIC), so each rank's inter-node share shrinks by `per_node`, up to the
    node's own link."""
    eff = hw.link_efficiency or DEFAULT_LINK_EFFICIENCY
    if link == "intra":
        return hw.intra_node_latency_us * 1e-6, hw.intra_node_gbps * 1e9 * eff
    bw = min(hw.inter_node_gbps * max(per_node, 1), hw.intra_node_gbps)
    # a ring through k members a node crosses the network on one hop in k, NVLink on the others
    k = max(per_node, 1) if link == "mixed" else 1
    latency = (hw.inter_node_latency_us + (k - 1) * hw.intra_node_latency_us) / k
    return latency * 1e-6, bw * 1e9 * eff


def host_dispatch(hw: HardwareSpec, axis: str, op: str = "") -> float:
    """Host seconds one collective of `axis` costs beyond its wire time: the runtime issues tp's
    through DTensor, FSDP's through its per-unit hooks and a cp core's through the functional
    collectives (`tp_dispatch_us`, `fsdp_dispatch_us`, `cp_dispatch_us`), work a CPU does in series
    with the compute and a GPU's host does ahead of the kernels (0 there)."""
    if axis.startswith("fsdp") or axis == "expert_fsdp":  # FSDP's hooks: over fsdp, fsdp×cp, or experts
        return hw.fsdp_dispatch_us * 1e-6
    if axis == "cp" and op not in (ALL_TO_ALL, ALL_GATHER, REDUCE_SCATTER):
        return 0.0  # the ring's bare send/recv pairs; DDP's all-reduce over a cp-only data group
    return {"tp": hw.tp_dispatch_us, "cp": hw.cp_dispatch_us}.get(axis, 0.0) * 1e-6


def in_ledger_words(comms: list[Collective], layout: Layout) -> list[Collective]:
    """The plan's collectives under the names the comm ledger gives them: the data-parallel
    gradients and ZeRO traffic of a layout with context parallelism travel over the flattened
    data×cp group (`fivefold.layout_math.replica_axis`: "cp", "dp_fsdp_cp", "fsdp_cp"), a stage's
    activations and their gradients both ways, as sends and as receives (half each), and each hop of
    a cp ring as a send and a receive of the same block (the hop's time half on each)."""
    from dataclasses import replace

    out: list[Collective] = []
    for c in comms:
        if c.axis == "pp" and c.op == SEND:
            half = {k: getattr(c, k) / 2 for k in ("bytes", "wire_bytes", "time_s", "exposed_s")}
            out.append(replace(c, count=c.count // 2, **half))
            out.append(replace(c, op=RECV, count=c.count - c.count // 2, **half))
            continue
        if c.axis == "cp" and c.op == SEND:  # a ring hop: every rank sends a block and receives one
            half = {k: getattr(c, k) / 2 for k in ("time_s", "exposed_s")}
            out.append(replace(c, **half))
            out.append(replace(c, op=RECV, **half))
            continue
        if layout.cp > 1 and c.axis == "fsdp":
            c = replace(c, axis=replica_axis(layout, ("fsdp", "cp")) or c.axis)
        elif layout.cp > 1 and c.axis == "dp" and layout.fsdp == 1 and c.group == layout.dp * layout.cp:
            # sharded over dp×cp (shard_group); ZeroRedundancyOptimizer's broadcasts stay on dp
            c = replace(c, axis=replica_axis(layout, ("dp", "fsdp", "cp")) or c.axis)
        out.append(c)
    return out


def collective_time(
    hw: HardwareSpec, op: str, payload: float, n: int, link: str, per_node: int = 1, axis: str = ""
) -> tuple[float, float]:
    """(wire bytes per rank, seconds) for one collective of `payload` bytes over n ranks; given the
    `axis` that issues it, the seconds include its host dispatch (`host_dispatch`)."""
    factor, steps = wire_factor(op, n)
    if steps == 0:
        return 0.0, 0.0
    alpha, beta = link_params(hw, link, per_node)
    wire = factor * payload
    if op.replace("-", "_") == ALL_TO_ALL and link == "mixed" and per_node > 1:
        # an all-to-all is no ring: each rank sends the share meant for the g members on its own node
        # over NVLink while the rest crosses its NIC, both at once
        g = min(per_node, n)
        net = link_params(hw, "inter")[1]
        nvlink = link_params(hw, "intra")[1]
        seconds = max(payload * (n - g) / n / net, payload * (g - 1) / n / nvlink)
        return wire, steps * alpha + seconds + host_dispatch(hw, axis, op)
    seconds = steps * alpha + wire / beta
    if op.replace("-", "_") == ALL_REDUCE and link != "intra" and n > 2:
        # across nodes NCCL also runs all-reduce down and up a (double binary) tree: 2·log2(n) hops
        # of latency where the ring pays 2(n-1), each rank sending its whole buffer up and down; its
        # tuner takes whichever is faster, which at thousands of ranks and small buckets is the tree
        tree = 2 * math.ceil(math.log2(n)) * alpha + 2 * payload / beta
        seconds = min(seconds, tree)
    return wire, seconds + host_dispatch(hw, axis, op)


@lru_cache(maxsize=4096)
def _axis_kind(stride: int, size: int, world: int, gpus_per_node: int) -> str:
    """Link kind of an axis of this stride and size, asked of `fivefold.mesh` on the smallest world
    with the same answer: the node pattern of its groups repeats every lcm(stride·size, node) ranks."""
    block = stride * size
    period = math.lcm(block, gpus_per_node)
    outer = period // block if world % period == 0 else world // block
    probe = Layout(tp=stride, cp=size, fsdp=outer, order="tp,cp,fsdp,dp,pp", zero=3 if outer > 1 else 0)
    return axis_link_kinds(probe, gpus_per_node)["cp"]


def links(layout: Layout, gpus_per_node: int) -> dict[str, str]:
    """Link kind per axis of size > 1 (from `fivefold.mesh`), cached per stride and size."""
    world = layout.world
    out: dict[str, str] = {}
    stride = 1
    for axis in layout.order_list:
        size = getattr(layout, axis)
        if size > 1:
            out[axis] = _axis_kind(stride, size, world, gpus_per_node)
        stride *= size
    return out


def ring_nics(layout: Layout, axes: tuple[str, ...], link: str, gpus_per_node: int) -> int:
    """NICs the rings of a group over `axes` are striped over (`link_params`' per_node): on a "mixed"
    link, its ranks that share a node (each axis contributes up to node/stride); else 1."""
    if link != "mixed":
        return 1
    st = strides(layout)
    out = 1
    for a in axes:
        size = getattr(layout, a)
        if size > 1:
            out *= min(size, max(1, gpus_per_node // st[a]))
    return max(1, min(out, gpus_per_node))


def worst_link(kinds: dict[str, str], *axes: str) -> str:
    """The slowest link among axes that form one group (e.g. fsdp×cp shards)."""
    found = [kinds[a] for a in axes if a in kinds]
    if not found:
        return "intra"
    return "intra" if all(k == "intra" for k in found) else ("inter" if "inter" in found else "mixed")


def ep_members_per_node(layout: Layout, gpus_per_node: int) -> int:
    """Members of an expert group on each node (`ep_link`'s ranks): the share of its all-to-all that
    stays on NVLink."""
    if layout.ep <= 1:
        return 1
    st = strides(layout)
    first = st["cp"] if layout.cp > 1 else st["fsdp"]
    return max(1, min(layout.ep, gpus_per_node // first)) if first < gpus_per_node else 1


def ep_link(layout: Layout, gpus_per_node: int) -> str:
    """Link of an expert group: the `ep` innermost ranks of the flattened fsdp×cp block (cp fastest)."""
    if layout.ep <= 1:
        return "intra"
    st = strides(layout)
    if layout.ep <= layout.cp:
        first, span = st["cp"], st["cp"] * layout.ep
    else:
        first = st["cp"] if layout.cp > 1 else st["fsdp"]
        span = st["fsdp"] * (layout.ep // layout.cp)
    if span <= gpus_per_node and gpus_per_node % span == 0:
        return "intra"
    return "inter" if first >= gpus_per_node else "mixed"
