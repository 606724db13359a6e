"""Small SVG charts as plain text (no plotting library, no network), for both reports:

- figures inside an HTML page (bubblesim.plan.report's report.html), styled by the page's CSS
  classes: every data mark (a point, a bar segment) has class "mark" and a <title> tooltip;
  each chart's <svg> carries data-plot (its id) and data-marks (how many marks it drew), which
  the report's check script compares with what the browser laid out;
- standalone .svg files with inline styles (replay.analysis.report's fidelity plots: latency CDFs,
  per-step scatter plots with a y = x diagonal, step timelines).

Both map data to pixels with one `Axis` and place ticks with one `ticks` (1-2-5 steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape


# ---- scales (both kinds) ---------------------------------------------------------------------
def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Ticks on [lo, hi] at a 1-2-5 step of at least (hi - lo) / n; an empty range is [lo, lo + 1].
    Values are rounded to 12 significant digits (0.3, not 0.30000000000000004)."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    count = int((hi - first) / step + 1e-9) + 1
    return [float(f"{first + i * step:.12g}") for i in range(count)]


def fmt_num(v: float) -> str:
    """Tick label of report.html: 1.5k, 12, 0.25."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v / 1000:g}k"
    if a >= 1:
        return f"{v:g}"
    return f"{v:.3g}"


def fmt_3g(v: float) -> str:
    """Tick label of the standalone files: 3 significant digits."""
    return f"{v:.3g}"


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
        return log_ticks(self.lo, self.hi) if self.log else ticks(self.lo, self.hi)


# ---- figures in an HTML page (bubblesim.plan.report) ---------------------------------------------
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


def _plotbg(ch: Chart) -> str:
    x0, y0, w, h = ch.plot_box()
    return f'<rect class="plotbg" x="{x0}" y="{y0}" width="{w}" height="{h}"/>'


def _xgrid(ch: Chart, xa: Axis, values: Sequence[float]) -> str:
    """A vertical grid line and a label under the plot at each of `values`."""
    x0, y0, w, h = ch.plot_box()
    out = []
    for t in values:
        x = x0 + xa.frac(t) * w
        out.append(
            f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{y0}" y2="{y0 + h}"/>'
            f'<text class="tick" x="{x:.1f}" y="{y0 + h + 16}" text-anchor="middle">'
            f"{fmt_num(t)}</text>"
        )
    return "".join(out)


def _xlabel(ch: Chart) -> str:
    x0, _, w, _ = ch.plot_box()
    return (
        f'<text class="label" x="{x0 + w / 2}" y="{ch.height - 8}" '
        f'text-anchor="middle">{escape(ch.x_label)}</text>'
    )


def _row_label(ch: Chart, y: float, label: str) -> str:
    """A category name left of the plot, its baseline at `y`."""
    x0 = ch.plot_box()[0]
    return f'<text class="tick" x="{x0 - 6}" y="{y:.1f}" text-anchor="end">{escape(label)}</text>'


def _frame(ch: Chart, xa: Axis, ya: Axis) -> str:
    x0, y0, w, h = ch.plot_box()
    out = [_plotbg(ch)]
    for t in ya.ticks():
        y = y0 + h - ya.frac(t) * h
        out.append(f'<line class="grid" x1="{x0}" x2="{x0 + w}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(
            f'<text class="tick" x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_num(t)}</text>'
        )
    out.append(_xgrid(ch, xa, xa.ticks()))
    out.append(_xlabel(ch))
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
    body = [_plotbg(ch), _xgrid(ch, Axis(0.0, total), ticks(0, total, 5))]
    for i, (label, segs) in enumerate(rows):
        yc = y0 + (i + 0.5) * h / n
        body.append(_row_label(ch, yc + 4, label))
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
    body.append(_xlabel(ch))
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
    xt = ticks(0, top, 5)
    if xt[-1] < top:  # end the axis on the next tick above the longest bar
        step = xt[1] - xt[0] if len(xt) > 1 else top
        xt.append(round(xt[-1] + step, 12))
    top = xt[-1]
    body = [_plotbg(ch), _xgrid(ch, Axis(0.0, top), xt)]
    for i, (label, bars) in enumerate(rows):
        band = h / n
        yb = y0 + i * band + band * 0.14
        bh = band * 0.72 / max(len(bars), 1)
        body.append(_row_label(ch, y0 + (i + 0.5) * band + 4, label))
        for j, (v, c, tip) in enumerate(bars):
            bw = max(v / top * w, 0.8)
            body.append(
                f'<rect class="mark" x="{x0}" y="{yb + j * bh:.1f}" width="{bw:.2f}" '
                f'height="{bh * 0.92:.1f}" fill="{c}"><title>{escape(tip)}</title></rect>'
            )
            ch.marks += 1
    body.append(_xlabel(ch))
    return ch.svg("".join(body), legend_html(list(names)))


# ---- standalone .svg files (replay.analysis.report) ----------------------------------------------
W, H = 640, 360
PAD_L, PAD_R, PAD_T, PAD_B = 64, 16, 32, 44
FILE_COLORS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
)

FileSeries = tuple[str, Sequence[float], Sequence[float]]  # label, xs, ys


def _file_color(i: int) -> str:
    return FILE_COLORS[i % len(FILE_COLORS)]


class _FileFrame:
    """Maps data to the plot area of a W x H file (an empty range widens to [lo, lo + 1]) and
    draws its axes."""

    def __init__(self, x0: float, x1: float, y0: float, y1: float) -> None:
        self.xa = Axis(x0, x1 if x1 > x0 else x0 + 1)
        self.ya = Axis(y0, y1 if y1 > y0 else y0 + 1)

    def px(self, x: float) -> float:
        return PAD_L + self.xa.frac(x) * (W - PAD_L - PAD_R)

    def py(self, y: float) -> float:
        return H - PAD_B - self.ya.frac(y) * (H - PAD_T - PAD_B)

    def x_tick_labels(self) -> list[str]:
        return [
            f'<text x="{self.px(t):.1f}" y="{H - PAD_B + 14}" text-anchor="middle" '
            f'font-size="10">{fmt_3g(t)}</text>'
            for t in self.xa.ticks()
        ]

    def axes(self, title: str, xlabel: str, ylabel: str) -> list[str]:
        out = [
            f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="14">{escape(title)}</text>',
            f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" '
            'stroke="#333"/>',
            f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{H - PAD_B}" stroke="#333"/>',
            f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle" font-size="12">'
            f"{escape(xlabel)}</text>",
            f'<text x="14" y="{H / 2}" text-anchor="middle" font-size="12" '
            f'transform="rotate(-90 14 {H / 2})">{escape(ylabel)}</text>',
            *self.x_tick_labels(),
        ]
        for t in self.ya.ticks():
            y = self.py(t)
            out.append(
                f'<text x="{PAD_L - 4}" y="{y + 3:.1f}" text-anchor="end" font-size="10">'
                f"{fmt_3g(t)}</text>"
                f'<line x1="{PAD_L}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" stroke="#eee"/>'
            )
        return out


def _file_doc(body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" font-family="sans-serif">\n'
        f'<rect width="{W}" height="{H}" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n"
    )


def _no_data(title: str) -> str:
    return _file_doc([f'<text x="20" y="40">{escape(title)}: no data</text>'])


def _file_legend(labels: Sequence[str]) -> list[str]:
    out = []
    for i, label in enumerate(labels):
        y = PAD_T + 8 + 14 * i
        out.append(
            f'<rect x="{W - PAD_R - 150}" y="{y - 8}" width="10" height="10" '
            f'fill="{_file_color(i)}"/><text x="{W - PAD_R - 136}" y="{y + 1}" '
            f'font-size="11">{escape(label)}</text>'
        )
    return out


def _finite(xs: Sequence[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x)]


def line_file(series: Sequence[FileSeries], title: str, xlabel: str, ylabel: str) -> str:
    """An SVG document: one polyline per (label, xs, ys) series (a CDF, say); y from 0."""
    xs = [x for _, sx, _ in series for x in _finite(sx)]
    ys = [y for _, _, sy in series for y in _finite(sy)]
    if not xs or not ys:
        return _no_data(title)
    f = _FileFrame(min(xs), max(xs), min(0.0, min(ys)), max(ys))
    body = f.axes(title, xlabel, ylabel)
    for i, (_, sx, sy) in enumerate(series):
        pts = " ".join(
            f"{f.px(x):.1f},{f.py(y):.1f}"
            for x, y in zip(sx, sy)
            if math.isfinite(x) and math.isfinite(y)
        )
        body.append(
            f'<polyline fill="none" stroke="{_file_color(i)}" stroke-width="1.5" points="{pts}"/>'
        )
    return _file_doc(body + _file_legend([label for label, _, _ in series]))


def scatter_file(
    xs: Sequence[float], ys: Sequence[float], title: str, xlabel: str, ylabel: str
) -> str:
    """An SVG document: dots (at most ~5000) on equal axes from 0, and the y = x diagonal."""
    pts = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
    if not pts:
        return _no_data(title)
    lo = min(0.0, min(min(p) for p in pts))
    hi = max(max(p) for p in pts)
    f = _FileFrame(lo, hi, lo, hi)
    body = f.axes(title, xlabel, ylabel)
    body.append(
        f'<line x1="{f.px(lo):.1f}" y1="{f.py(lo):.1f}" x2="{f.px(hi):.1f}" y2="{f.py(hi):.1f}" '
        'stroke="#999" stroke-dasharray="4 3"/>'
    )
    step = max(1, len(pts) // 5000)
    for x, y in pts[::step]:
        body.append(
            f'<circle cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="1.6" fill="{_file_color(0)}" '
            'fill-opacity="0.5"/>'
        )
    return _file_doc(body)


def timeline_file(
    tracks: Sequence[tuple[str, Sequence[tuple[float, float, int]]]],
    t0: float,
    t1: float,
    title: str,
    legend: Sequence[str] = (),
) -> str:
    """An SVG document: one row per track of (start, end, colour index) boxes, clipped to
    [t0, t1] (ms since trace start); `legend` names the first colours."""
    f = _FileFrame(t0, t1, 0, 1)
    body = [f'<text x="{W / 2}" y="14" text-anchor="middle" font-size="13">{escape(title)}</text>']
    top = PAD_T + 8  # the legend sits between the title and the first track
    row_h = (H - top - PAD_B) / max(1, len(tracks))
    for r, (label, boxes) in enumerate(tracks):
        y = top + r * row_h
        body.append(
            f'<text x="{PAD_L - 4}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end" '
            f'font-size="11">{escape(label)}</text>'
        )
        for s, e, c in boxes:
            if e < t0 or s > t1:
                continue
            x0, x1 = f.px(max(s, t0)), f.px(min(e, t1))
            body.append(
                f'<rect x="{x0:.2f}" y="{y + 2:.1f}" width="{max(x1 - x0, 0.3):.2f}" '
                f'height="{row_h - 4:.1f}" fill="{_file_color(c)}"/>'
            )
    body += f.x_tick_labels()
    body.append(
        f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle" font-size="12">'
        "time since trace start (ms)</text>"
    )
    body += [
        f'<rect x="{PAD_L + 90 * i}" y="20" width="10" height="10" '
        f'fill="{_file_color(i)}"/><text x="{PAD_L + 90 * i + 13}" y="29" '
        f'font-size="10">{escape(name)}</text>'
        for i, name in enumerate(legend)
    ]
    return _file_doc(body)
