"""Inline SVG charts for `rollstore report`: line charts, stacked and grouped bars, histograms.

Invariants:
- Output is a self-contained `<svg>` element (no external fonts, scripts, styles or images) whose
  text is HTML-escaped; every mark carries a `<title>` with its exact value, so hovering shows the
  number the query returned.
- Pure functions of their arguments: the same data gives byte-identical SVG.
- Non-finite and missing values (None, NaN, ±inf) are skipped, never drawn at a wrong place.
- The legend names every series drawn: it wraps onto as many lines as it needs (the chart grows
  taller), and legend entries and marks carry the series' name in `data-series`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

# Okabe-Ito: distinguishable with the common colour-vision deficiencies.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#7f7f7f", "#000000"]

WIDTH, HEIGHT = 540, 260
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 58, 14, 44, 44


@dataclass
class Series:
    name: str
    points: list[tuple[float, float | None]]
    color: str | None = None
    dashed: bool = False
    markers: bool | None = None  # None: markers when the series has few points
    band: list[tuple[float, float, float]] | None = None  # (x, low, high): a shaded range around the line


@dataclass
class Plot:
    """Linear maps from data to the plotting area of a chart."""

    x0: float
    x1: float
    y0: float
    y1: float
    width: int = WIDTH
    height: int = HEIGHT
    marks: list[str] = field(default_factory=list)

    def sx(self, x: float) -> float:
        span = self.x1 - self.x0 or 1.0
        return MARGIN_L + (x - self.x0) / span * (self.width - MARGIN_L - MARGIN_R)

    def sy(self, y: float) -> float:
        span = self.y1 - self.y0 or 1.0
        return self.height - MARGIN_B - (y - self.y0) / span * (self.height - MARGIN_T - MARGIN_B)


def finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def fmt(v, digits: int = 4) -> str:
    """A number as the report prints it: integers whole, floats with `digits` significant digits."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.{digits}g}"
    return str(v)


def tick_text(v: float) -> str:
    """A y tick's label, at most 5 characters for the counts the report draws, so it stays clear of the
    rotated axis label at its left: whole values as integers (`1200`, not `1.2e+03`), from 10 000 on in
    thousands (`12k`) or millions (`1.2M`); other values with 3 significant digits."""
    if isinstance(v, (int, float)) and math.isfinite(v) and float(v) == round(v):
        n = int(round(v))
        if abs(n) >= 1_000_000:
            return f"{n / 1e6:.3g}M"
        if abs(n) >= 10_000:
            return f"{n / 1e3:.3g}k"
        return str(n)
    return fmt(v, 3)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [lo, hi]."""
    if not (finite(lo) and finite(hi)):
        return []
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks = []
    t = start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks and ticks[-1] < hi:
        ticks.append(round(ticks[-1] + step, 12))
    return ticks


def _open(title: str, width: int = WIDTH, height: int = HEIGHT) -> list[str]:
    return [
        (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">'),
        f"<title>{escape(title)}</title>",
        f'<text x="{MARGIN_L}" y="16" class="ct">{escape(title)}</text>',
    ]


def _axes(p: Plot, xticks: list[float], yticks: list[float], x_label: str, y_label: str,
          xtick_text=None) -> list[str]:
    out = []
    left, right = MARGIN_L, p.width - MARGIN_R
    top, bottom = MARGIN_T, p.height - MARGIN_B
    for t in yticks:
        y = p.sy(t)
        out.append(f'<line x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        out.append(f'<text x="{left - 5}" y="{y + 3.5:.1f}" text-anchor="end" class="tick">{escape(tick_text(t))}</text>')
    for t in xticks:
        x = p.sx(t)
        label = xtick_text(t) if xtick_text else fmt(t, 3)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" class="axis"/>')
        out.append(f'<text x="{x:.1f}" y="{bottom + 15}" text-anchor="middle" class="tick">{escape(label)}</text>')
    out.append(f'<line x1="{left}" x2="{right}" y1="{bottom}" y2="{bottom}" class="axis"/>')
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{bottom}" class="axis"/>')
    out.append(f'<text x="{(left + right) / 2:.1f}" y="{p.height - 8}" text-anchor="middle" class="al">{escape(x_label)}</text>')
    cy = (top + bottom) / 2
    out.append(f'<text x="11" y="{cy:.1f}" text-anchor="middle" transform="rotate(-90 11 {cy:.1f})" class="al">'
               f"{escape(y_label)}</text>")
    return out


LEGEND_ROW = 14  # pixels between legend lines


def _legend_rows(names: list[tuple[str, str, bool]], width: int) -> list[list[tuple[float, str, str, bool]]]:
    """Every legend entry placed left to right, wrapping onto further lines: (x, name, color, dashed)."""
    rows: list[list[tuple[float, str, str, bool]]] = [[]]
    x = MARGIN_L
    for name, color, dashed in names:
        w = 6.2 * len(name) + 30
        if x + w > width - MARGIN_R and rows[-1]:
            rows.append([])
            x = MARGIN_L
        rows[-1].append((x, name, color, dashed))
        x += w
    return rows if rows[0] else []


def _finish(parts: list[str], names: list[tuple[str, str, bool]], title: str, width: int, height: int) -> str:
    """Close a chart: its legend names every series (on as many lines as it takes, the plot moved
    down by the extra lines, the SVG taller by as much); each entry and each mark carry the
    series' name in `data-series`, so a reader (or a test) can match marks to legend entries."""
    rows = _legend_rows(names, width)
    extra = LEGEND_ROW * max(0, len(rows) - 1)
    out = _open(title, width, height + extra)
    for k, row in enumerate(rows):
        y = 28 + LEGEND_ROW * k
        for x, name, color, dashed in row:
            dash = ' stroke-dasharray="4 3"' if dashed else ""
            out.append(f'<g class="lgi" data-series="{escape(name)}"><line x1="{x:.0f}" x2="{x + 14:.0f}" y1="{y}" '
                       f'y2="{y}" stroke="{color}" stroke-width="2.5"{dash}/>'
                       f'<text x="{x + 18:.0f}" y="{y + 4}" class="lg">{escape(name)}</text></g>')
    body = parts[3:]  # after _open's three elements
    if extra:
        out.append(f'<g transform="translate(0 {extra})">')
        out += body
        out.append("</g>")
    else:
        out += body
    out.append("</svg>")
    return "".join(out)


def empty_chart(title: str, message: str) -> str:
    parts = _open(title, WIDTH, 80)
    parts.append(f'<text x="{MARGIN_L}" y="48" class="tick">{escape(message)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def line_chart(series: list[Series], *, title: str, x_label: str, y_label: str,
               y_range: tuple[float, float] | None = None, integer_x: bool = False) -> str:
    pts = [(x, y) for s in series for x, y in s.points if finite(x) and finite(y)]
    pts += [(x, y) for s in series for x, lo, hi in (s.band or []) for y in (lo, hi) if finite(x) and finite(y)]
    if not pts:
        return empty_chart(title, "no data")
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    y_lo, y_hi = (min(ys), max(ys)) if y_range is None else y_range
    if y_range is None and 0 <= y_lo < 0.5 * y_hi:
        y_lo = 0.0  # small positive values: start the axis at zero
    yticks = nice_ticks(y_lo, y_hi)
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:  # one x value: centre it
        x_lo, x_hi = x_lo - 1, x_hi + 1
    xticks = nice_ticks(x_lo, x_hi, 6)
    if integer_x:
        xticks = sorted({round(t) for t in xticks if x_lo - 1e-9 <= t <= x_hi + 1e-9} | {round(x_lo), round(x_hi)})
        if len(xticks) > 8:
            xticks = xticks[:: math.ceil(len(xticks) / 8)]
    else:
        xticks = [t for t in xticks if x_lo - 1e-9 <= t <= x_hi + 1e-9]
    p = Plot(x_lo, x_hi, yticks[0], yticks[-1])
    parts = _open(title)
    parts += _axes(p, xticks, yticks, x_label, y_label)
    legend = []
    for i, s in enumerate(series):
        color = s.color or PALETTE[i % len(PALETTE)]
        legend.append((s.name, color, s.dashed))
        dash = ' stroke-dasharray="5 4"' if s.dashed else ""
        band = [(x, lo, hi) for x, lo, hi in (s.band or []) if finite(x) and finite(lo) and finite(hi)]
        if len(band) > 1:
            outline = [f"{p.sx(x):.1f},{p.sy(hi):.1f}" for x, _, hi in band]
            outline += [f"{p.sx(x):.1f},{p.sy(lo):.1f}" for x, lo, _ in reversed(band)]
            parts.append(f'<polygon fill="{color}" fill-opacity="0.15" stroke="none" points="{" ".join(outline)}"/>')
        run: list[str] = []
        segments: list[list[str]] = []
        for x, y in s.points:
            if finite(x) and finite(y):
                run.append(f"{p.sx(x):.1f},{p.sy(y):.1f}")
            elif run:
                segments.append(run)
                run = []
        if run:
            segments.append(run)
        for seg in segments:
            if len(seg) > 1:
                parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} '
                             f'data-series="{escape(s.name)}" points="{" ".join(seg)}"/>')
        good = [(x, y) for x, y in s.points if finite(x) and finite(y)]
        show = s.markers if s.markers is not None else len(good) <= 120
        if show or len(good) == 1:
            for x, y in good:
                parts.append(f'<circle cx="{p.sx(x):.1f}" cy="{p.sy(y):.1f}" r="3" fill="{color}" '
                             f'data-series="{escape(s.name)}">'
                             f"<title>{escape(s.name)}: {escape(x_label)} {fmt(x)} → {fmt(y, 6)}</title></circle>")
    return _finish(parts, legend, title, WIDTH, HEIGHT)


def stacked_bars(categories: list[str], stacks: list[tuple[str, list[float], str]], *, title: str,
                 x_label: str, y_label: str) -> str:
    """Vertical bars, one per category, each stacked from `stacks` (name, values per category, color)."""
    if not categories:
        return empty_chart(title, "no data")
    totals = [sum(v[i] or 0 for _, v, _ in stacks) for i in range(len(categories))]
    yticks = nice_ticks(0, max(totals) or 1)
    n = len(categories)
    p = Plot(0, n, 0, yticks[-1])
    parts = _open(title)
    step = max(1, math.ceil(n / 12))
    parts += _axes(p, [i + 0.5 for i in range(0, n, step)], yticks, x_label, y_label,
                   xtick_text=lambda t: categories[int(t)])
    bw = (p.sx(1) - p.sx(0)) * 0.8
    for i, cat in enumerate(categories):
        base = 0.0
        for name, values, color in stacks:
            v = values[i] or 0
            if v <= 0:
                continue
            y_top, y_bot = p.sy(base + v), p.sy(base)
            parts.append(f'<rect x="{p.sx(i) + bw * 0.125:.1f}" y="{y_top:.1f}" width="{bw:.1f}" '
                         f'height="{max(0.5, y_bot - y_top):.1f}" fill="{color}" data-series="{escape(name)}">'
                         f"<title>{escape(x_label)} {escape(cat)}: {escape(name)} {fmt(v)}</title></rect>")
            base += v
    return _finish(parts, [(name, color, False) for name, values, color in stacks if any(values)], title, WIDTH,
                   HEIGHT)


def grouped_hbars(categories: list[str], groups: list[tuple[str, list[float | None], str]], *, title: str,
                  x_label: str, x_range: tuple[float, float] = (0.0, 1.0)) -> str:
    """Horizontal bars: one row per category, one bar per group (name, values, color)."""
    if not categories:
        return empty_chart(title, "no data")
    left = 120
    row_h = 12 * len(groups) + 10
    height = MARGIN_T + row_h * len(categories) + 40
    width = WIDTH
    span = (x_range[1] - x_range[0]) or 1.0

    def sx(v):
        return left + (v - x_range[0]) / span * (width - left - MARGIN_R)

    parts = _open(title, width, height)
    bottom = height - 30
    for t in nice_ticks(*x_range):
        if x_range[0] - 1e-9 <= t <= x_range[1] + 1e-9:
            x = sx(t)
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MARGIN_T}" y2="{bottom}" class="grid"/>')
            parts.append(f'<text x="{x:.1f}" y="{bottom + 13}" text-anchor="middle" class="tick">{fmt(t, 3)}</text>')
    parts.append(f'<text x="{(left + width) / 2:.0f}" y="{height - 4}" text-anchor="middle" class="al">{escape(x_label)}</text>')
    for i, cat in enumerate(categories):
        y0 = MARGIN_T + i * row_h + 5
        parts.append(f'<text x="{left - 6}" y="{y0 + row_h / 2:.1f}" text-anchor="end" class="tick">{escape(cat)}</text>')
        for j, (name, values, color) in enumerate(groups):
            v = values[i]
            if not finite(v):
                continue
            y = y0 + j * 12
            parts.append(f'<rect x="{left}" y="{y:.1f}" width="{max(0.5, sx(v) - left):.1f}" height="10" fill="{color}" '
                         f'data-series="{escape(name)}"><title>{escape(cat)}: {escape(name)} {fmt(v, 6)}</title></rect>')
    parts.append(f'<line x1="{left}" x2="{left}" y1="{MARGIN_T}" y2="{bottom}" class="axis"/>')
    return _finish(parts, [(name, color, False) for name, _, color in groups], title, width, height)


def histogram(edges: list[float], series: list[tuple[str, list[int], str]], *, title: str, x_label: str,
              y_label: str, width: int = WIDTH) -> str:
    """Overlaid histograms on shared bins (len(edges) == bins + 1), drawn as outlined steps."""
    if not edges or not series:
        return empty_chart(title, "no data")
    top = max((max(c) for _, c, _ in series if c), default=0) or 1
    yticks = nice_ticks(0, top)
    lo, hi = edges[0], edges[-1]
    p = Plot(lo, hi if hi > lo else lo + 1, 0, yticks[-1], width=width)
    parts = _open(title, width)
    parts += _axes(p, [t for t in nice_ticks(lo, hi, 6) if lo - 1e-9 <= t <= hi + 1e-9], yticks, x_label, y_label)
    for name, counts, color in series:
        path = [f"M{p.sx(edges[0]):.1f},{p.sy(0):.1f}"]
        for i, c in enumerate(counts):
            path.append(f"L{p.sx(edges[i]):.1f},{p.sy(c):.1f}L{p.sx(edges[i + 1]):.1f},{p.sy(c):.1f}")
        path.append(f"L{p.sx(edges[-1]):.1f},{p.sy(0):.1f}Z")
        parts.append(f'<path d="{"".join(path)}" fill="{color}" fill-opacity="0.18" stroke="{color}" stroke-width="1.6" '
                     f'data-series="{escape(name)}"/>')
        for i, c in enumerate(counts):
            if c:
                x, w = p.sx(edges[i]), p.sx(edges[i + 1]) - p.sx(edges[i])
                parts.append(f'<rect x="{x:.1f}" y="{p.sy(c):.1f}" width="{max(w, 0.5):.1f}" height="{p.sy(0) - p.sy(c):.1f}" '
                             f'fill="transparent"><title>{escape(name)}: [{fmt(edges[i])}, {fmt(edges[i + 1])}) '
                             f"{c}</title></rect>")
    return _finish(parts, [(name, color, False) for name, _, color in series], title, width, HEIGHT)
