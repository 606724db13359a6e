"""Three small chart kinds written as plain SVG text (no plotting library on the GPU host):
line charts (latency CDFs), scatter plots with a y = x diagonal (per-step times), and timelines
(one row per track, coloured boxes). Each returns the SVG document as a string.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

W, H = 640, 360
PAD_L, PAD_R, PAD_T, PAD_B = 64, 16, 32, 44
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")

Series = tuple[str, Sequence[float], Sequence[float]]  # label, xs, ys


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not hi > lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(x: float) -> str:
    return f"{x:.3g}"


class _Frame:
    """Maps data coordinates to the plot area and draws axes."""

    def __init__(self, x0: float, x1: float, y0: float, y1: float, logx: bool = False):
        self.logx = logx
        if logx:
            x0, x1 = math.log10(max(x0, 1e-12)), math.log10(max(x1, 1e-12))
        self.x0, self.x1 = x0, x1 if x1 > x0 else x0 + 1
        self.y0, self.y1 = y0, y1 if y1 > y0 else y0 + 1

    def px(self, x: float) -> float:
        if self.logx:
            x = math.log10(max(x, 1e-12))
        return PAD_L + (x - self.x0) / (self.x1 - self.x0) * (W - PAD_L - PAD_R)

    def py(self, y: float) -> float:
        return H - PAD_B - (y - self.y0) / (self.y1 - self.y0) * (H - PAD_T - PAD_B)

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
        ]
        xt = (
            [10**e for e in range(math.floor(self.x0), math.ceil(self.x1) + 1)]
            if self.logx
            else _ticks(self.x0, self.x1)
        )
        for t in xt:
            x = self.px(t)
            if PAD_L - 1 <= x <= W - PAD_R + 1:
                out.append(
                    f'<text x="{x:.1f}" y="{H - PAD_B + 14}" text-anchor="middle" '
                    f'font-size="10">{_fmt(t)}</text>'
                )
        for t in _ticks(self.y0, self.y1):
            y = self.py(t)
            out.append(
                f'<text x="{PAD_L - 4}" y="{y + 3:.1f}" text-anchor="end" font-size="10">'
                f"{_fmt(t)}</text>"
                f'<line x1="{PAD_L}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" stroke="#eee"/>'
            )
        return out


def _doc(body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" font-family="sans-serif">\n'
        f'<rect width="{W}" height="{H}" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n"
    )


def _legend(labels: Sequence[str]) -> list[str]:
    out = []
    for i, label in enumerate(labels):
        y = PAD_T + 8 + 14 * i
        out.append(
            f'<rect x="{W - PAD_R - 150}" y="{y - 8}" width="10" height="10" '
            f'fill="{COLORS[i % len(COLORS)]}"/><text x="{W - PAD_R - 136}" y="{y + 1}" '
            f'font-size="11">{escape(label)}</text>'
        )
    return out


def _finite(xs: Sequence[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x)]


def line_chart(series: Sequence[Series], title: str, xlabel: str, ylabel: str, logx=False) -> str:
    xs = [x for _, sx, _ in series for x in _finite(sx) if not logx or x > 0]
    ys = [y for _, _, sy in series for y in _finite(sy)]
    if not xs or not ys:
        return _doc([f'<text x="20" y="40">{escape(title)}: no data</text>'])
    f = _Frame(min(xs), max(xs), min(0.0, min(ys)), max(ys), logx)
    body = f.axes(title, xlabel, ylabel)
    for i, (_, sx, sy) in enumerate(series):
        pts = " ".join(
            f"{f.px(x):.1f},{f.py(y):.1f}"
            for x, y in zip(sx, sy)
            if math.isfinite(x) and math.isfinite(y) and (not logx or x > 0)
        )
        body.append(
            f'<polyline fill="none" stroke="{COLORS[i % len(COLORS)]}" stroke-width="1.5" '
            f'points="{pts}"/>'
        )
    return _doc(body + _legend([label for label, _, _ in series]))


def scatter(xs: Sequence[float], ys: Sequence[float], title: str, xlabel: str, ylabel: str) -> str:
    pts = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
    if not pts:
        return _doc([f'<text x="20" y="40">{escape(title)}: no data</text>'])
    lo = min(0.0, min(min(p) for p in pts))
    hi = max(max(p) for p in pts)
    f = _Frame(lo, hi, lo, hi)
    body = f.axes(title, xlabel, ylabel)
    body.append(
        f'<line x1="{f.px(lo):.1f}" y1="{f.py(lo):.1f}" x2="{f.px(hi):.1f}" y2="{f.py(hi):.1f}" '
        'stroke="#999" stroke-dasharray="4 3"/>'
    )
    step = max(1, len(pts) // 5000)  # at most ~5000 dots
    for x, y in pts[::step]:
        body.append(
            f'<circle cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="1.6" fill="{COLORS[0]}" '
            'fill-opacity="0.5"/>'
        )
    return _doc(body)


def timeline(
    tracks: Sequence[tuple[str, Sequence[tuple[float, float, int]]]],
    t0: float,
    t1: float,
    title: str,
    legend: Sequence[str] = (),
) -> str:
    """tracks: (label, [(start, end, colour index), ...]); times in the unit of t0/t1 (ms)."""
    f = _Frame(t0, t1, 0, 1)
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
                f'height="{row_h - 4:.1f}" fill="{COLORS[c % len(COLORS)]}"/>'
            )
    for t in _ticks(t0, t1):
        body.append(
            f'<text x="{f.px(t):.1f}" y="{H - PAD_B + 14}" text-anchor="middle" '
            f'font-size="10">{_fmt(t)}</text>'
        )
    body.append(
        f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle" font-size="12">'
        "time since trace start (ms)</text>"
    )
    if legend:
        body += [
            f'<rect x="{PAD_L + 90 * i}" y="20" width="10" height="10" '
            f'fill="{COLORS[i % len(COLORS)]}"/><text x="{PAD_L + 90 * i + 13}" y="29" '
            f'font-size="10">{escape(name)}</text>'
            for i, name in enumerate(legend)
        ]
    return _doc(body)
