"""The mesh as the page draws it: how to find each rank's group along an axis, by arithmetic.

The page never receives per-rank group lists (16,384 ranks × six axes × every layout would not
fit in a page); it receives, per axis, the strides and sizes of the world axes the axis spans
and which slice of their flattened index it is. `group_of` is that arithmetic in Python; the
page runs the same few lines, and tests check both against `build_mesh`'s groups.
Only the axes a user chooses are shown: dp, fsdp, tp, pp, cp and, on a model with experts, ep.
The runtime's derived dims (batch, fsdp_cp, dp_fsdp_cp, expert_fsdp) are combinations of these.
"""

from __future__ import annotations

from typing import Any

from fivefold.config import Layout
from fivefold.mesh import axis_link_kinds, comm_words, link_kind, strides, summarize_links

SHOWN_AXES = ("tp", "cp", "ep", "fsdp", "dp", "pp")


def addressing(layout: Layout) -> dict[str, dict[str, Any]]:
    """Per shown axis of size > 1: the world axes it spans (stride, size), innermost first, and its
    coordinate as a slice (lo, size) of their flattened index (the DeviceMesh convention)."""
    st, order = strides(layout), layout.order_list

    def parts(axes: tuple[str, ...]) -> list[list[int]]:
        return [[st[a], getattr(layout, a)] for a in sorted(axes, key=order.index)]

    out: dict[str, dict[str, Any]] = {}
    for axis in SHOWN_AXES:
        size = getattr(layout, axis)
        if size <= 1:
            continue
        # ep folds onto the fsdp×cp ranks: its coordinate is that flattened index modulo ep
        spans = ("fsdp", "cp") if axis == "ep" else (axis,)
        out[axis] = {"parts": parts(spans), "lo": 1, "size": size}
    return out


def group_of(rank: int, address: dict[str, Any]) -> tuple[tuple[int, int], int]:
    """(key shared by the rank's group, the rank's position in it)."""
    flat, scale, base = 0, 1, rank
    for stride, size in address["parts"]:
        c = (rank // stride) % size
        flat += c * scale
        scale *= size
        base -= c * stride
    pos = (flat // address["lo"]) % address["size"]
    return (base, flat - pos * address["lo"]), pos


def groups(world: int, address: dict[str, Any]) -> list[list[int]]:
    """Every group of the axis, each in rank order, ordered by first rank (as `build_mesh`)."""
    buckets: dict[tuple[int, int], list[int]] = {}
    for r in range(world):
        buckets.setdefault(group_of(r, address)[0], []).append(r)
    return sorted(buckets.values(), key=lambda g: g[0])


def mesh_view(layout: Layout, gpus_per_node: int) -> dict[str, Any]:
    """What the grid needs for a resolved layout: sizes, link summary, collective words, addressing."""
    links = axis_link_kinds(layout, gpus_per_node)
    address = addressing(layout)
    dims = []
    for axis in SHOWN_AXES:
        if axis not in address:
            continue
        if axis == "ep":  # folded dims have no stride of their own: read the link off the groups
            gs = groups(layout.world, address[axis])
            link = summarize_links([link_kind(g, gpus_per_node) for g in gs], len(gs[0]))
        else:
            link = links[axis]
        dims.append(
            {
                "name": axis,
                "size": getattr(layout, axis),
                "link": link,
                "comm": comm_words(axis, layout),
                "groups_count": layout.world // getattr(layout, axis),
                **address[axis],
            }
        )
    return {"world": layout.world, "gpus_per_node": gpus_per_node, "order": layout.order, "dims": dims}
