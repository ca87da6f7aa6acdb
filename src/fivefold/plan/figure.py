"""The planner against published runs as a picture: predicted against published MFU, one dot a run.

`fivefold plan --validate/--cross-validate --plot FILE.svg` draws it. Both axes are MFU on the
planner's FLOP convention and 16-bit peak (a run that publishes tokens/s or TFLOP/s is converted the
way its error is), on log scales so that a 5% MFU run and a 60% one sit at the same error from the
diagonal. The bands are ±10% and ±25% (#12's targets); each source has its colour, runs with an
`uncertain` note are hollow, and every dot names its run on hover. Written by hand, not with a plot
library, so that the picture needs nothing beyond fivefold's own dependencies.
"""

from __future__ import annotations

import math
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fivefold.plan.validation import Validation

# twelve colours that stay apart for the usual kinds of colour blindness (Okabe-Ito, then Tol's)
PALETTE = (
    "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9",
    "#999933", "#882255", "#44AA99", "#332288", "#AA4499", "#117733",
)  # fmt: skip
BANDS = ((0.25, "#e6eef7"), (0.10, "#c9dbee"))  # (half-width, shade), drawn widest first
HIGH = 1.0  # the MFU axis ends at the peak; it starts a little below the lowest dot, at 1% at least
TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
SIZE, MARGIN, LEGEND = 460, 64, 330


def _axis_low(v: Validation) -> float:
    """The axis' low end: the tick below the lowest MFU drawn (published or predicted)."""
    lowest = min((m for p in v.predictions for m in (p.published_mfu, p.mfu) if m > 0), default=0.1)
    return max((t for t in TICKS if t <= lowest / 1.1), default=TICKS[0])


def validation_svg(v: Validation, title: str) -> str:
    """An SVG of every prediction of `v` against its published MFU, with a legend per source."""
    x0, y0 = MARGIN, 40 + SIZE  # the plot's low-left corner
    width, height = MARGIN + SIZE + 24 + LEGEND, y0 + 56
    low = _axis_low(v)

    def pos(mfu: float) -> float:  # pixels from the low corner (log scale; outside: on the edge)
        return SIZE * math.log(min(max(mfu, low), HIGH) / low) / math.log(HIGH / low)

    def xy(published: float, predicted: float) -> tuple[float, float]:
        return x0 + pos(published), y0 - pos(predicted)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{x0}" y="22" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for band, shade in BANDS:
        # the region between predicted = published·(1 - band) and ·(1 + band), sampled along the axis
        steps = [low * (HIGH / low) ** (i / 40) for i in range(41)]
        upper = [xy(m, m * (1 + band)) for m in steps]
        lower = [xy(m, m * (1 - band)) for m in reversed(steps)]
        points = " ".join(f"{x:.1f},{max(min(y, y0), y0 - SIZE):.1f}" for x, y in upper + lower)
        out.append(f'<polygon points="{points}" fill="{shade}"><title>within ±{band:.0%}</title></polygon>')
    out.append(
        f'<line x1="{x0}" y1="{y0}" x2="{x0 + SIZE}" y2="{y0 - SIZE}" stroke="#666" stroke-dasharray="4 3"/>'
    )
    out.append(f'<rect x="{x0}" y="{y0 - SIZE}" width="{SIZE}" height="{SIZE}" fill="none" stroke="#333"/>')
    for tick in (t for t in TICKS if t >= low):
        p = pos(tick)
        label = f"{tick:.0%}"
        out.append(f'<line x1="{x0 + p:.1f}" y1="{y0}" x2="{x0 + p:.1f}" y2="{y0 + 5}" stroke="#333"/>')
        out.append(f'<text x="{x0 + p:.1f}" y="{y0 + 18}" text-anchor="middle">{label}</text>')
        out.append(f'<line x1="{x0 - 5}" y1="{y0 - p:.1f}" x2="{x0}" y2="{y0 - p:.1f}" stroke="#333"/>')
        out.append(f'<text x="{x0 - 8}" y="{y0 - p + 4:.1f}" text-anchor="end">{label}</text>')
    out.append(f'<text x="{x0 + SIZE / 2}" y="{y0 + 40}" text-anchor="middle">published MFU</text>')
    out.append(
        f'<text x="16" y="{y0 - SIZE / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {y0 - SIZE / 2})">predicted MFU</text>'
    )
    sources = v.by_source()
    colour = {source: PALETTE[i % len(PALETTE)] for i, source in enumerate(sources)}
    for p in sorted(v.predictions, key=lambda p: -abs(p.error)):  # the worst drawn first, under the rest
        x, y = xy(p.published_mfu, p.mfu)
        fill = "none" if p.uncertain else colour[p.source]
        note = " (uncertain)" if p.uncertain else ""
        tip = (
            f"{p.run}{note}, {p.source}: published {p.published:.4g} {p.metric}, predicted "
            f"{p.predicted:.4g} ({p.error:+.1%}); MFU {p.published_mfu:.1%} vs {p.mfu:.1%}"
        )
        out.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="{fill}" stroke="{colour[p.source]}" '
            f'stroke-width="1.5" fill-opacity="0.8"><title>{escape(tip)}</title></circle>'
        )
    lx, ly = x0 + SIZE + 24, 64
    out.append(f'<text x="{lx}" y="{ly - 20}" font-weight="bold">source: runs, mean |error|, worst</text>')
    for i, (source, preds) in enumerate(sources.items()):
        s = v.summary(preds)
        y = ly + 20 * i
        out.append(f'<circle cx="{lx + 6}" cy="{y - 4}" r="5" fill="{colour[source]}"/>')
        line = f"{source}: {s['runs']}, {s['mean']:.1%}, {s['worst']:.1%}"
        out.append(f'<text x="{lx + 18}" y="{y}">{escape(line)}</text>')
    y = ly + 20 * len(sources) + 14
    total = v.summary()
    for line in (
        f"all {total['runs']} runs: mean {total['mean']:.1%}, worst {total['worst']:.1%}",
        f"median-constant predictor: mean {total['constant_mean']:.1%}",
        "bands: within ±10%, ±25%; hollow: a run marked uncertain",
    ):
        out.append(f'<text x="{lx}" y="{y}">{escape(line)}</text>')
        y += 18
    out.append("</svg>")
    return "\n".join(out) + "\n"
