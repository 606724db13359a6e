"""Small inline-SVG charts for report.html: no library, no network.

Every data mark (a point, a bar segment) has class "mark" and a <title> tooltip; each chart's
<svg> carries data-plot (its id) and data-marks (how many marks it drew), which the report's
check script compares with what the browser laid out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def fmt_num(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v / 1000:g}k"
    if a >= 1:
        return f"{v:g}"
    return f"{v:.3g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    ticks = []
    t = start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks per decade; every integer mantissa on a narrow range, decades on a wide one."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)

    def pick(mantissas: tuple[int, ...]) -> list[float]:
        vals = (float(f"{m * 10.0**k:.12g}") for k in decades for m in mantissas)
        return [v for v in vals if lo <= v <= hi]

    out = pick((1, 2, 5))
    if len(out) < 3:
        out = pick(tuple(range(1, 10)))
    elif len(out) > 8:
        out = pick((1,))
    return out


@dataclass
class Axis:
    lo: float
    hi: float
    log: bool = False

    @staticmethod
    def fit(values: Sequence[float], log: bool = False, zero: bool = False) -> Axis:
        vals = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)]
        if not vals:
            return Axis(0.1 if log else 0.0, 1.0, log)
        lo, hi = min(vals), max(vals)
        if log:
            if hi <= lo:
                lo, hi = lo / 2, hi * 2
            return Axis(lo / 1.25, hi * 1.25, True)
        if zero:
            lo = min(0.0, lo)
        pad = (hi - lo) * 0.08 or abs(hi) * 0.1 or 1.0
        return Axis(lo if zero else lo - pad, hi + pad, False)

    def frac(self, v: float) -> float:
        if self.log:
            return (math.log(v) - math.log(self.lo)) / (math.log(self.hi) - math.log(self.lo))
        return (v - self.lo) / (self.hi - self.lo)

    def ticks(self) -> list[float]:
        return log_ticks(self.lo, self.hi) if self.log else nice_ticks(self.lo, self.hi)


@dataclass
class Series:
    name: str
    points: list[tuple[float, float, bool, str]]  # x, y, filled (False = lower bound), tooltip
    color: str
    dashed: bool = False
    markers: bool = True  # False: a line only (no marks), e.g. an estimate


@dataclass
class Chart:
    plot_id: str
    title: str
    x_label: str
    y_label: str
    width: int = 640
    height: int = 340
    margin: tuple[int, int, int, int] = (34, 20, 46, 64)  # top, right, bottom, left
    parts: list[str] = field(default_factory=list)
    marks: int = 0

    def plot_box(self) -> tuple[float, float, float, float]:
        t, r, b, left = self.margin
        return left, t, self.width - left - r, self.height - t - b

    def svg(self, body: str, legend: str = "") -> str:
        return (
            f'<figure class="chart"><svg xmlns="http://www.w3.org/2000/svg" '
            f'data-plot="{escape(self.plot_id)}" data-marks="{self.marks}" '
            f'viewBox="0 0 {self.width} {self.height}" width="{self.width}" '
            f'height="{self.height}" role="img" aria-label="{escape(self.title)}">'
            f'<text class="title" x="{self.width / 2}" y="18" text-anchor="middle">'
            f"{escape(self.title)}</text>{body}</svg>{legend}</figure>"
        )


def _frame(ch: Chart, xa: Axis, ya: Axis) -> str:
    x0, y0, w, h = ch.plot_box()
    out = [f'<rect class="plotbg" x="{x0}" y="{y0}" width="{w}" height="{h}"/>']
    for t in ya.ticks():
        y = y0 + h - ya.frac(t) * h
        out.append(f'<line class="grid" x1="{x0}" x2="{x0 + w}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(
            f'<text class="tick" x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_num(t)}</text>'
        )
    for t in xa.ticks():
        x = x0 + xa.frac(t) * w
        out.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{y0}" y2="{y0 + h}"/>')
        out.append(
            f'<text class="tick" x="{x:.1f}" y="{y0 + h + 16}" text-anchor="middle">'
            f"{fmt_num(t)}</text>"
        )
    out.append(
        f'<text class="label" x="{x0 + w / 2}" y="{ch.height - 8}" '
        f'text-anchor="middle">{escape(ch.x_label)}</text>'
    )
    out.append(
        f'<text class="label" transform="translate(14,{y0 + h / 2}) rotate(-90)" '
        f'text-anchor="middle">{escape(ch.y_label)}</text>'
    )
    return "".join(out)


def legend_html(items: Sequence[tuple[str, str]], extra: str = "") -> str:
    spans = "".join(f'<span><i style="background:{c}"></i>{escape(n)}</span>' for n, c in items)
    return f'<figcaption class="legend">{spans}{extra}</figcaption>'


def line_chart(
    ch: Chart,
    series: Sequence[Series],
    xlog: bool = False,
    ylog: bool = False,
    hlines: Sequence[tuple[float, str]] = (),
    vlines: Sequence[tuple[float, str]] = (),
    extra_legend: str = "",
) -> str:
    xs = [p[0] for s in series for p in s.points] + [v for v, _ in vlines]
    ys = [p[1] for s in series for p in s.points] + [v for v, _ in hlines]
    xa, ya = Axis.fit(xs, xlog), Axis.fit(ys, ylog, zero=not ylog)
    x0, y0, w, h = ch.plot_box()

    def px(v: float) -> float:
        return x0 + min(max(xa.frac(v), 0.0), 1.0) * w

    def py(v: float) -> float:
        return y0 + h - min(max(ya.frac(v), 0.0), 1.0) * h

    body = [_frame(ch, xa, ya)]
    for v, label in hlines:
        body.append(
            f'<line class="slo" x1="{x0}" x2="{x0 + w}" y1="{py(v):.1f}" y2="{py(v):.1f}"/>'
            f'<text class="slotext" x="{x0 + w - 4}" y="{py(v) - 5:.1f}" '
            f'text-anchor="end">{escape(label)}</text>'
        )
    for v, label in vlines:
        body.append(
            f'<line class="vref" x1="{px(v):.1f}" x2="{px(v):.1f}" y1="{y0}" '
            f'y2="{y0 + h}"/><text class="vtext" x="{px(v) + 4:.1f}" y="{y0 + 12}">'
            f"{escape(label)}</text>"
        )
    for s in series:
        pts = [p for p in s.points if p[1] is not None and (p[1] > 0 or not ylog)]
        solid = [p for p in pts if p[2]]  # lower bounds (open marks) are not joined
        if len(solid) > 1:
            coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _, _ in solid)
            dash = ' stroke-dasharray="6 4"' if s.dashed else ""
            body.append(f'<polyline class="series" points="{coords}" stroke="{s.color}"{dash}/>')
        for x, y, filled, tip in pts if s.markers else []:
            fill = s.color if filled else "#fff"
            body.append(
                f'<circle class="mark" cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" '
                f'fill="{fill}" stroke="{s.color}"><title>{escape(tip)}</title>'
                "</circle>"
            )
            ch.marks += 1
    legend = legend_html([(s.name, s.color) for s in series if s.markers], extra_legend)
    return ch.svg("".join(body), legend)


def stacked_bars(
    ch: Chart,
    rows: Sequence[tuple[str, Sequence[tuple[str, float]]]],
    colors: dict[str, str],
    unit: str = "%",
) -> str:
    """Horizontal bars, one per row, of named segments (values in `unit`, summing to ~100)."""
    x0, y0, w, h = ch.plot_box()
    n = max(len(rows), 1)
    bar_h = min(26.0, h / n * 0.72)
    total = max((sum(v for _, v in segs) for _, segs in rows), default=1.0) or 1.0
    body = [f'<rect class="plotbg" x="{x0}" y="{y0}" width="{w}" height="{h}"/>']
    for t in nice_ticks(0, total, 5):
        x = x0 + t / total * w
        body.append(
            f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{y0}" y2="{y0 + h}"/>'
            f'<text class="tick" x="{x:.1f}" y="{y0 + h + 16}" text-anchor="middle">'
            f"{fmt_num(t)}</text>"
        )
    for i, (label, segs) in enumerate(rows):
        yc = y0 + (i + 0.5) * h / n
        body.append(
            f'<text class="tick" x="{x0 - 6}" y="{yc + 4:.1f}" text-anchor="end">'
            f"{escape(label)}</text>"
        )
        x = x0
        for name, v in segs:
            bw = max(v / total * w, 0.0)
            if bw <= 0:
                continue
            body.append(
                f'<rect class="mark" x="{x:.2f}" y="{yc - bar_h / 2:.1f}" '
                f'width="{max(bw, 0.8):.2f}" height="{bar_h:.1f}" fill="{colors[name]}">'
                f"<title>{escape(label)}: {escape(name)} {v:.2f} {unit}</title></rect>"
            )
            ch.marks += 1
            x += bw
    body.append(
        f'<text class="label" x="{x0 + w / 2}" y="{ch.height - 8}" '
        f'text-anchor="middle">{escape(ch.x_label)}</text>'
    )
    legend = legend_html(list(colors.items()))
    return ch.svg("".join(body), legend)


def bar_chart(
    ch: Chart,
    rows: Sequence[tuple[str, Sequence[tuple[float, str, str]]]],
    names: Sequence[tuple[str, str]],
) -> str:
    """Horizontal grouped bars: per row, (value, color, tooltip) bars side by side."""
    x0, y0, w, h = ch.plot_box()
    n = max(len(rows), 1)
    top = max((v for _, bars in rows for v, _, _ in bars), default=1.0) or 1.0
    body = [f'<rect class="plotbg" x="{x0}" y="{y0}" width="{w}" height="{h}"/>']
    ticks = nice_ticks(0, top, 5)
    if ticks[-1] < top:  # end the axis on the next tick above the longest bar
        step = ticks[1] - ticks[0] if len(ticks) > 1 else top
        ticks.append(round(ticks[-1] + step, 12))
    top = ticks[-1]
    for t in ticks:
        x = x0 + t / top * w
        body.append(
            f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{y0}" y2="{y0 + h}"/>'
            f'<text class="tick" x="{x:.1f}" y="{y0 + h + 16}" text-anchor="middle">'
            f"{fmt_num(t)}</text>"
        )
    for i, (label, bars) in enumerate(rows):
        band = h / n
        yb = y0 + i * band + band * 0.14
        bh = band * 0.72 / max(len(bars), 1)
        body.append(
            f'<text class="tick" x="{x0 - 6}" y="{y0 + (i + 0.5) * band + 4:.1f}" '
            f'text-anchor="end">{escape(label)}</text>'
        )
        for j, (v, c, tip) in enumerate(bars):
            bw = max(v / top * w, 0.8)
            body.append(
                f'<rect class="mark" x="{x0}" y="{yb + j * bh:.1f}" width="{bw:.2f}" '
                f'height="{bh * 0.92:.1f}" fill="{c}"><title>{escape(tip)}</title></rect>'
            )
            ch.marks += 1
    body.append(
        f'<text class="label" x="{x0 + w / 2}" y="{ch.height - 8}" '
        f'text-anchor="middle">{escape(ch.x_label)}</text>'
    )
    return ch.svg("".join(body), legend_html(list(names)))
