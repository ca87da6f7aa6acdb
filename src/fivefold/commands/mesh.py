"""`fivefold mesh`: which ranks talk to which for a layout, inside or across nodes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from html import escape
from pathlib import Path

from fivefold.config import AXES, add_layout_arguments, check_gpus, layout_from_args
from fivefold.errors import FivefoldError
from fivefold.outputs import is_stream, write_text_whole

# dims shown in the picture and accepted by --axis
PICTURE_DIMS = AXES + ("ep", "expert_fsdp", "fsdp_cp", "batch", "dp_fsdp_cp")
PALETTE = [
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#1b9e77",
    "#d95f02",
    "#7570b3",
    "#e7298a",
    "#66a61e",
    "#e6ab02",
]
ANSI = [33, 208, 160, 73, 70, 178, 133, 211, 94, 145, 36, 166, 61, 162, 64, 136]  # 256-colour codes


GRID_RANKS = 256  # the per-rank grid beyond this many ranks would not fit a terminal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, required=True, help="world size")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    add_layout_arguments(parser, factors_only=True)
    parser.add_argument(
        "--axis",
        default=None,
        choices=PICTURE_DIMS,
        help="dim whose groups the picture colours (default: the innermost of size > 1)",
    )
    parser.add_argument(
        "--ranks",
        default=None,
        metavar="A-B",
        help=f"ranks the per-rank grid shows (default: the first {GRID_RANKS})",
    )
    parser.add_argument("--svg", default=None, metavar="FILE", help="also write the picture as an SVG file")
    parser.add_argument("--json", action="store_true", help="print only the mesh's JSON object")
    parser.add_argument(
        "--color",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ANSI colours in the picture (default: when stdout is a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BrokenPipeError:  # `fivefold mesh ... | head`: the reader left, which is fine
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silences the flush at exit
        return 0


def _run(args: argparse.Namespace) -> int:
    misnamed = args.svg and not args.svg.lower().endswith(".svg") and not is_stream(args.svg)
    if misnamed:  # an SVG in a file named .png would open as a broken picture
        raise FivefoldError(f"--svg writes an SVG: give a FILE.svg (got --svg {args.svg})")
    from fivefold.mesh import build_mesh

    check_gpus(args.gpus)
    layout = layout_from_args(args)  # with neither --dp nor --fsdp, dp fills what the others leave
    info = build_mesh(layout, args.gpus, args.gpus_per_node)
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:  # drawn, but rarely meant
        full, left = divmod(args.gpus, args.gpus_per_node)
        print(
            f"note: {args.gpus} GPUs fill {full} nodes of {args.gpus_per_node} and {left} GPU(s) of one "
            "more; the last node is drawn partly used",
            file=sys.stderr,
        )
    ranks = parse_ranks(args.ranks, info.world)  # checked before anything is printed or written
    if args.json:
        print(json.dumps(info.to_json()))
        if args.svg:
            _write_svg(info, _pick_axis(info, args.axis), args.svg, ranks)
        return 0
    axis = _pick_axis(info, args.axis)
    color = sys.stdout.isatty() if args.color is None else args.color
    print(render_table(info))
    print()
    from fivefold.mesh import describe

    print(describe(info))
    print()
    print(render_grid(info, axis, color, ranks))
    if args.svg:
        _write_svg(info, axis, args.svg, ranks)
        print(f"\nwrote {args.svg}")
    return 0


def _pick_axis(info, axis: str | None) -> str:
    if axis:
        return axis
    return next((a for a in info.layout.order_list if info.dims[a].size > 1), "tp")


def _write_svg(info, axis: str, path: str, ranks: range) -> None:
    # no half-written file on a full disk
    write_text_whole(Path(path), render_svg(info, axis, ranks), "--svg")


def render_table(info) -> str:
    """The mesh table: Dim, Factor, Groups, Links, Comm; world axes innermost first, then EP."""
    from fivefold.mesh import LINK_WORDS

    names = list(info.layout.order_list)
    if info.layout.ep > 1:
        names += ["ep", "expert_fsdp"]
    if info.layout.cp > 1 and info.layout.fsdp > 1:
        names.append("fsdp_cp")
    rows = [("Dim", "Factor", "Groups", "Links", "Comm")]
    for name in names:
        d = info.dims[name]
        if d.size == 1:
            rows.append((name.upper(), "1", "—", "—", "—"))
        else:
            rows.append((name.upper(), str(d.size), str(len(d.groups)), LINK_WORDS[d.link], d.comm))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _group_index(info, axis: str) -> dict[int, int]:
    return {r: i for i, g in enumerate(info.dims[axis].groups) for r in g}


def parse_ranks(text: str | None, world: int) -> range:
    """`--ranks A-B` (inclusive) as a range of ranks; default the first GRID_RANKS."""
    if text is None:
        return range(min(world, GRID_RANKS))
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last if sep else first)
    except ValueError:
        lo, hi = -1, -1
    if not 0 <= lo <= hi < world:
        raise FivefoldError(f"--ranks must be A-B with 0 <= A <= B < {world} (the world size), got {text!r}")
    return range(lo, hi + 1)


def render_grid(info, axis: str, color: bool = False, ranks: range | None = None) -> str:
    """Nodes × GPUs for the nodes holding `ranks`; each cell is `rank:group` of `axis`, coloured by group
    when `color`. Columns stay aligned at any size."""
    ranks = ranks if ranks is not None else range(info.world)
    index = _group_index(info, axis)
    d = info.dims[axis]
    g = info.gpus_per_node
    columns = min(g, info.world)  # a node bigger than the world draws no empty columns (nor hangs)
    nodes = range(ranks.start // g, (ranks.stop - 1) // g + 1)
    head = f"{axis} groups ({d.size} ranks each, {len(d.groups)} groups); cell = rank:group"
    if len(ranks) < info.world:
        head += f"; ranks {ranks.start}-{ranks.stop - 1} of {info.world} (--ranks A-B shows others)"
    shown = [r for n in nodes for r in range(n * g, min((n + 1) * g, info.world))]
    width = max([len(f"{r}:{index[r]}") for r in shown] + [len(f"gpu{columns - 1}")])
    label = len(f"node {nodes[-1]}") + 2
    lines = [head, " " * label + " ".join(f"gpu{i}".rjust(width) for i in range(columns))]
    for node in nodes:
        cells = []
        for local in range(columns):
            rank = node * g + local
            if rank >= info.world or rank not in ranks:
                cells.append(" " * width)
                continue
            text = f"{rank}:{index[rank]}".rjust(width)
            if color:
                text = f"\x1b[38;5;{ANSI[index[rank] % len(ANSI)]}m{text}\x1b[0m"
            cells.append(text)
        lines.append(f"node {node}".ljust(label) + " ".join(cells))
    return "\n".join(lines)


def render_svg(info, axis: str, ranks: range | None = None) -> str:
    """The same picture as a standalone SVG: one row per node, one cell per GPU, for the nodes holding
    `ranks` (the grid's window: the first GRID_RANKS unless --ranks says)."""
    ranks = ranks if ranks is not None else range(info.world)
    index = _group_index(info, axis)
    d = info.dims[axis]
    cell, gap, left, top = 56, 6, 70, 46
    g = info.gpus_per_node
    columns = min(g, info.world)  # as in render_grid
    nodes = range(ranks.start // g, (ranks.stop - 1) // g + 1)
    width = left + columns * (cell + gap) + 10
    height = top + len(nodes) * (cell + gap) + 10
    title = f"{escape(axis)}: {d.size} ranks per group, {len(d.groups)} groups, {escape(d.link)}"
    if len(ranks) < info.world:
        title += f"; ranks {ranks.start}-{ranks.stop - 1} of {info.world}"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<text x="10" y="20" font-size="14">{title}</text>',
    ]
    for row, node in enumerate(nodes):
        y = top + row * (cell + gap)
        out.append(f'<text x="10" y="{y + cell // 2 + 4}">node {node}</text>')
        out.append(
            f'<rect x="{left - 3}" y="{y - 3}" width="{columns * (cell + gap)}" '
            f'height="{cell + 6}" fill="none" stroke="#999"/>'
        )
        for local in range(columns):
            rank = node * info.gpus_per_node + local
            if rank >= info.world or rank not in ranks:
                continue
            x = left + local * (cell + gap)
            fill = PALETTE[index[rank] % len(PALETTE)]
            out.append(
                f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" rx="6" fill="{fill}">'
                f"<title>rank {rank}, {escape(axis)} group {index[rank]}</title></rect>"
            )
            out.append(
                f'<text x="{x + cell / 2}" y="{y + 24}" text-anchor="middle" fill="#fff">r{rank}</text>'
            )
            out.append(
                f'<text x="{x + cell / 2}" y="{y + 42}" text-anchor="middle" fill="#fff" '
                f'font-size="10">g{index[rank]}</text>'
            )
    out.append("</svg>")
    return "\n".join(out) + "\n"
