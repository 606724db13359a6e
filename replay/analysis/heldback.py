"""Held-back sweep points: which a refit leaves out, and the per-region error of predicting them.

A piecewise GPU model (replay.analysis.gpufit) is refitted without every HOLD_EVERY-th grid value
per axis (interior points only, so their neighbours stay in and the prediction is an interpolation),
then predicts them: the per-region error reads as "how well does the profile interpolate"
between the points the sweep measured. Regions: decode and verify by num_reqs (DECODE_BANDS),
mixed by num_tokens (MIXED_BANDS). numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from replay.analysis.gpufit import TABLE_X, TABLE_Y, Cols, TableNodes, table_rule, uniform_rows

HOLD_EVERY = 3  # every 3rd grid value per axis (interior points only)
HELD_BACK_OK = 0.05  # the verdict's bound on a region's max relative error
DECODE_BANDS = (1, 8, 32, 128)  # num_reqs band edges of the decode (and verify) regions
MIXED_BANDS = (1, 256, 2048)  # num_tokens band edges of the mixed regions


def decode_hold(cols: Cols, rows: np.ndarray, nodes: TableNodes):
    """Rows held back: uniform rows on interior nodes (i, j) with i % HOLD_EVERY == 1 and
    j % HOLD_EVERY == 1 (their neighbours stay in), and every HOLD_EVERY-th row off the nodes.
    i counts the x nodes rows sit on: a graph step's first node (no row, replay.analysis.graphsteps)
    before every bucket's midpoint would otherwise take the pattern's place."""
    t = table_rule()
    ys = nodes.ys
    x, yv = t.axis_values(TABLE_X, cols), t.axis_values(TABLE_Y, cols)
    sits = x[rows & uniform_rows(cols)]
    xs = [v for v in nodes.xs if v not in nodes.breaks or np.isclose(sits, v).any()]
    ix = np.searchsorted(np.array(xs), x)
    iy = np.searchsorted(np.array(ys), yv)
    on = (ix < len(xs)) & (iy < len(ys))
    on &= np.isclose(np.array(xs)[np.minimum(ix, len(xs) - 1)], x)
    on &= np.isclose(np.array(ys)[np.minimum(iy, len(ys) - 1)], yv)
    interior = (ix > 0) & (ix < len(xs) - 1) & (iy > 0) & (iy < len(ys) - 1)
    every = HOLD_EVERY
    node = rows & uniform_rows(cols) & on
    grid = node & interior & (ix % every == 1) & (iy % every == 1)
    other = np.flatnonzero(rows & ~node)  # off the grid: non-uniform rows, verify widths
    hold = grid.copy()
    hold[other[1::every]] = True
    return hold


def mixed_hold(cols: Cols, rows: np.ndarray) -> np.ndarray:
    """Every HOLD_EVERY-th row (file order), but never the smallest or largest num_tokens."""
    idx = np.flatnonzero(rows)
    hold = np.zeros(len(rows), bool)
    if idx.size == 0:
        return hold
    tok = cols["num_tokens"]
    lo, hi = tok[idx].min(), tok[idx].max()
    pick = idx[1::HOLD_EVERY]
    hold[pick[(tok[pick] > lo) & (tok[pick] < hi)]] = True
    return hold


def region_errors(
    kind: str, cols: Cols, pred: np.ndarray, meas: np.ndarray, rows: np.ndarray
) -> dict[str, Any]:
    """n, median and max |relative error| per band (num_reqs for decode, num_tokens for mixed;
    decode steps with drafts apart, as `decode verify`) and over all `rows`."""
    field, edges = ("num_tokens", MIXED_BANDS) if kind == "mixed" else ("num_reqs", DECODE_BANDS)
    rel = np.abs(pred - meas) / meas
    v = cols[field]
    short = "t" if kind == "mixed" else "b"

    def summary(mask: np.ndarray) -> dict[str, Any]:
        r = rel[mask]
        return {"n": int(r.size), "median_rel": float(np.median(r)), "max_rel": float(r.max())}

    out: dict[str, Any] = {}
    bounds = [*edges, np.inf]
    verify = cols["draft_tokens"] > 0 if kind == "decode" else np.zeros(len(v), bool)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        mask = rows & (v >= lo) & (v < hi) & ~verify
        if mask.any():
            name = f"{kind} {short}{lo}+" if hi == np.inf else f"{kind} {short}{lo}-{int(hi) - 1}"
            out[name] = summary(mask)
    if (rows & verify).any():  # spec verify steps: another attention kernel (paged_attention)
        out[f"{kind} verify"] = summary(rows & verify)
    if rows.any():
        out[f"{kind} all"] = summary(rows)
    return out


def verdict(regions: Mapping[str, Mapping[str, Any]]) -> str:
    """One line: every region's held-back points within HELD_BACK_OK, or which are not."""
    alls = {k: v for k, v in regions.items() if k.endswith(" all")}
    if not alls:
        return "held-back sweep points: none (no piecewise GPU model was fitted)"
    parts = [
        f"{k[:-4]} median {100 * v['median_rel']:.1f} % max {100 * v['max_rel']:.1f} % "
        f"({v['n']} points)"
        for k, v in alls.items()
    ]
    bad = [
        f"{k} (max {100 * v['max_rel']:.1f} %)"
        for k, v in regions.items()
        if not k.endswith(" all") and v["max_rel"] > HELD_BACK_OK
    ]
    end = (
        f"within {100 * HELD_BACK_OK:.0f} % everywhere"
        if not bad
        else f"ABOVE {100 * HELD_BACK_OK:.0f} % in " + ", ".join(bad)
    )
    return "held-back sweep points: " + "; ".join(parts) + ": " + end
