"""Server-side SVG drawings: the lineage chain of an artifact and the KL-per-sample plot.

Drawn as text so that pages need no JavaScript and no image requests; every label and link is
escaped here because the result is marked safe for the templates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

_NODE_W = 168
_NODE_H = 54
_GAP = 46
_PAD = 12


@dataclass(frozen=True)
class LineageNode:
    """One box of the lineage chain: an artifact, or a marker standing for several hidden ones."""

    title: str
    subtitle: str
    href: str | None
    role: str  # "ancestor", "current", "child", "more" (a count of hidden artifacts) or "missing"


def _box(node: LineageNode, x: float, y: float) -> str:
    label = escape(node.title)
    sub = escape(node.subtitle)
    body = (
        f'<rect class="node node-{escape(node.role)}" x="{x:.0f}" y="{y:.0f}" width="{_NODE_W}" height="{_NODE_H}" rx="6"/>'
        f'<text class="node-title" x="{x + _NODE_W / 2:.0f}" y="{y + 22:.0f}">{label}</text>'
        f'<text class="node-sub" x="{x + _NODE_W / 2:.0f}" y="{y + 40:.0f}">{sub}</text>'
    )
    if node.href is None:
        return f"<g>{body}</g>"
    return f'<a href="{escape(node.href)}" class="node-link"><title>{label} {sub}</title>{body}</a>'


def _arrow(x1: float, y1: float, x2: float, y2: float) -> str:
    return f'<path class="edge" d="M{x1:.0f},{y1:.0f} C{(x1 + x2) / 2:.0f},{y1:.0f} {(x1 + x2) / 2:.0f},{y2:.0f} {x2 - 6:.0f},{y2:.0f}" marker-end="url(#arrow)"/>'


def lineage_svg(chain: Sequence[LineageNode], current: LineageNode, children: Sequence[LineageNode]) -> Markup:
    """The chain root ... parent -> current -> children, left to right, children stacked.

    ``chain`` runs from the root to the direct parent (markers for hidden stretches included);
    each box links to its artifact page.
    """
    columns = len(chain) + 1 + (1 if children else 0)
    rows = max(1, len(children))
    width = _PAD * 2 + columns * _NODE_W + (columns - 1) * _GAP
    height = _PAD * 2 + rows * _NODE_H + (rows - 1) * 14
    mid = height / 2 - _NODE_H / 2
    parts = [
        f'<svg class="lineage" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
        f'viewBox="0 0 {width} {height:.0f}" role="img" aria-label="lineage: {len(chain)} ancestor box(es), '
        f'{len(children)} child box(es)">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path class="arrow-head" d="M0,0 L10,5 L0,10 z"/></marker></defs>',
    ]
    x = float(_PAD)
    for node in chain:
        parts.append(_box(node, x, mid))
        parts.append(_arrow(x + _NODE_W, mid + _NODE_H / 2, x + _NODE_W + _GAP, mid + _NODE_H / 2))
        x += _NODE_W + _GAP
    parts.append(_box(current, x, mid))
    cx = x + _NODE_W
    x += _NODE_W + _GAP
    for i, child in enumerate(children):
        y = _PAD + i * (_NODE_H + 14)
        parts.append(_arrow(cx, mid + _NODE_H / 2, x, y + _NODE_H / 2))
        parts.append(_box(child, x, y))
    parts.append("</svg>")
    return Markup("".join(parts))


@dataclass(frozen=True)
class PlotSeries:
    """Points (sample index, value) drawn in one style, named in the legend."""

    name: str
    css_class: str
    points: Sequence[tuple[int, float]]


def _nice_max(value: float) -> float:
    if value <= 0 or not math.isfinite(value):
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        top = step * 10.0**exponent
        if top >= value:
            return top
    return 10.0 ** (exponent + 1)


def _finite(value: object) -> float | None:
    # The value as a finite float, or None (inf, nan, an int beyond float range, not a number).
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _tick_label(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.3g}"


def kl_plot_svg(series: Sequence[PlotSeries], *, y_label: str = "KL(fresh || graft), nats") -> Markup:
    """A dot plot of values per sample index, one colour per series, with axes and a legend.

    The y axis starts at 0 so that exact samples (KL 0) lie on the axis; a series whose values
    are all 0 is said so in the legend rather than hidden. Total over what a signed record may
    hold: a value that is not finite (or an int no float can hold) is drawn at the top of the
    axis and named in its tooltip; a point whose index is not a finite number is left out and
    counted in the legend.
    """
    width = 880
    left, right, bottom = 64, 16, 36
    # The legend sits above the plot, one line per series, so it never covers a point.
    top = 30 + 16 * len(series)
    height = top + 200 + bottom
    xs = [x for s in series for i, _ in s.points if (x := _finite(i)) is not None]
    ys = [y for s in series for _, v in s.points if (y := _finite(v)) is not None]
    x_min = min(0.0, min(xs, default=0.0))
    x_max = max(xs, default=0.0)
    # Halves: the span of two finite floats may itself overflow.
    half_span = x_max / 2 - x_min / 2
    span = x_max - x_min
    y_max = _nice_max(max(ys, default=0.0))
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        # Half a step of margin at both ends keeps the first and last points off the frame.
        return left + plot_w * ((x / 2 - x_min / 2 + 0.25) / (half_span + 0.5))

    def py(v: float) -> float:
        return top + plot_h * (1 - max(0.0, min(v, y_max)) / y_max)

    parts = [
        f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(y_label)} per sample">',
        f'<rect class="plot-bg" x="{left}" y="{top}" width="{plot_w}" height="{plot_h}"/>',
    ]
    for k in range(5):
        v = y_max * k / 4
        y = py(v)
        parts.append(f'<line class="grid" x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    if math.isfinite(span):
        step = float(max(1, _nice_step(span))) if span <= 1e15 else _nice_max(span / 8)
        count = int(span // step) + 1
        ticks = sorted({x_min, x_max, *(x_min + k * step for k in range(min(count, 12)))})
    else:
        ticks = [x_min, x_max]
    for x in ticks:
        parts.append(
            f'<text class="tick" x="{px(x):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{_tick_label(x)}</text>'
        )
    parts.append(f'<text class="axis-label" x="{left + plot_w / 2:.0f}" y="{height - 4}" text-anchor="middle">sample index</text>')
    parts.append(f'<text class="axis-label" x="{left}" y="{top - 8}">{escape(y_label)}</text>')
    for n, s in enumerate(series):
        values = [v for _, v in s.points]
        note = " (all 0)" if values and all(v == 0 for v in values) else ""
        left_out = sum(1 for i, _ in s.points if _finite(i) is None)
        if left_out:
            note += f" ({left_out} point{'' if left_out == 1 else 's'} with an index beyond the axis not drawn)"
        label = escape(f"{s.name}{note}")
        parts.append(f'<text class="legend {escape(s.css_class)}" x="{left + plot_w}" y="{14 + 16 * n}" text-anchor="end">\u25cf {label}</text>')
    for s in series:
        for i, v in s.points:
            x = _finite(i)
            if x is None:
                continue
            y = _finite(v)
            shown = y if y is not None else y_max
            value = f"{y:.6g}" if y is not None else _describe(v)
            parts.append(
                f'<circle class="dot {escape(s.css_class)}" cx="{px(x):.1f}" cy="{py(shown):.1f}" r="3.5">'
                f"<title>{escape(s.name)}: sample {escape(_tick_label(x))}, {escape(value)}</title></circle>"
            )
    parts.append("</svg>")
    return Markup("".join(parts))


def _describe(value: object) -> str:
    # A value no finite float holds, in words short enough for a tooltip.
    if isinstance(value, int) and not isinstance(value, bool):
        digits = len(str(abs(value)))
        return f"{'-' if value < 0 else ''}an integer of {digits} digits"
    return str(value)[:40]


def _nice_step(x_max: float) -> int:
    if x_max <= 10:
        return 1
    return int(_nice_max(x_max / 8))
