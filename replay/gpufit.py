"""Piecewise GPU pass fits from a shape sweep: a decode table and a mixed-step spline.

One global linear decode model, fitted where a calibration run went (batch < 32, ~10k KV
tokens a step), over-predicted a long-output workload by 14-23 % (docs/cost-model.md). These fits
hold over the sweep's whole grid instead, each still plain (weighted) least squares:

- decode (`fit_decode`): a table over (num_tokens, kv_per_token) with bilinear interpolation
  (sim.cost.table). Nodes are the values the sweep's uniform rows (every request of one context)
  take on each axis; every cell is a coefficient of the rule's own weights (`table_weights`),
  so a row on a node pins its cell and a row between nodes pins its four. A small penalty on
  each cell's departure from the linear interpolation of its neighbours (per axis) fixes the
  cells no row reaches (a corner the sweep's KV budget cut off) by linear continuation, as the
  evaluator continues past the edge. Rows whose batch mixes one long context among short ones
  may run slower than the KV stream (the longest attention program): the `{"max": [...]}`
  straggler branch, a spline in num_tokens through the table's first column (the step without
  KV) + c x program_keys, with c fitted by the same hinge iteration as the linear form's.
- mixed (`fit_mixed`): a linear spline in num_tokens (hat functions at log-spaced knots) plus
  linear attention terms, non-negative.
Rows are weighted by 1 / measured ms (relative error: a 1 ms decode and a 40 ms prefill count
alike). `held_back` refits with every HOLD_EVERY-th grid point per axis left out and predicts
them: the per-region error a user can read as "how well does the profile interpolate".

numpy only (the GPU host has no scipy or polars).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from replay.lsq import fit, numeric_rank

Cols = Mapping[str, np.ndarray]

TABLE_X, TABLE_Y = "num_tokens", "kv_per_token"
MAX_NODES = 24  # per axis; more distinct values are thinned (log-spaced, ends kept)
NODE_MERGE = 0.05  # values within 5 % of a node are one node (rows between nodes interpolate)
MAX_KNOTS = 10  # spline knots (log-spaced over the rows' num_tokens)
PENALTY = 0.05  # weight of a cell's curvature, relative to one row's relative error
STRAGGLER_START = 1.05  # rows this far above the table seed the straggler fit
MIN_STRAGGLER_ROWS = 2  # c is one number: two rows that straggle clearly pin it
HOLD_EVERY = 3  # held-back check: every 3rd grid value per axis (interior points only)
HELD_BACK_OK = 0.05  # the verdict's bound on a region's max relative error
DECODE_BANDS = (1, 8, 32, 128)  # num_reqs band edges of the decode regions
MIXED_BANDS = (1, 256, 2048)  # num_tokens band edges of the mixed regions


@dataclass
class PiecewiseFit:
    model: dict[str, Any]  # the gpu_pass model (profile format)
    report: dict[str, Any]  # what the fit found (nodes, straggler c, offsets)
    rows: np.ndarray  # bool: the rows it was fitted on


def _table_mod() -> Any:
    import sim.cost.table as t  # pure Python + numpy: the profile format's rule

    return t


# ---- nodes -------------------------------------------------------------------------------------
def _nodes(values: np.ndarray, most: int) -> list[float]:
    """The distinct values (those within NODE_MERGE of the previous kept one merge into it),
    thinned to `most` (log-spaced picks, first and last kept)."""
    v = np.unique(values[np.isfinite(values)])
    if len(v) > 1:
        keep = [0]
        for i in range(1, len(v)):
            if v[i] > v[keep[-1]] * (1 + NODE_MERGE):
                keep.append(i)
        v = v[keep]
    if len(v) <= most:
        return [float(x) for x in v]
    want = np.geomspace(max(v[0], 1e-9), v[-1], most)
    picks = sorted({int(np.argmin(np.abs(np.log(v) - np.log(w)))) for w in want} | {0, len(v) - 1})
    return [float(v[i]) for i in picks]


def uniform_rows(cols: Cols) -> np.ndarray:
    """Rows whose requests all read the same context (the sweep's grid rows)."""
    return cols["max_kv_tokens"] * cols["num_reqs"] == cols["kv_read_tokens"]


def _curvature(nodes: Sequence[float]) -> np.ndarray:
    """(n-2, n) rows: node i minus the linear interpolation of nodes i-1 and i+1."""
    n = len(nodes)
    out = np.zeros((max(n - 2, 0), n))
    for i in range(1, n - 1):
        h1, h2 = nodes[i] - nodes[i - 1], nodes[i + 1] - nodes[i]
        out[i - 1, i - 1 : i + 2] = (-h2 / (h1 + h2), 1.0, -h1 / (h1 + h2))
    return out


def _table_penalty(xs: Sequence[float], ys: Sequence[float]) -> np.ndarray:
    nx, ny = len(xs), len(ys)
    cx, cy = _curvature(xs), _curvature(ys)
    rows = [np.kron(cx, np.eye(ny)), np.kron(np.eye(nx), cy)]
    return (
        np.vstack([r for r in rows if r.size])
        if any(r.size for r in rows)
        else np.zeros((0, nx * ny))
    )


def _solve(w: np.ndarray, y: np.ndarray, pen: np.ndarray, extra: np.ndarray | None = None):
    """Relative least squares of y on [w, extra] + PENALTY x each node's curvature relative to
    the node's value (a first pass at the median target estimates the values), so a 1 % kink
    costs alike at 1 ms and at 50 ms; w's part >= 0 by clipping, extra's by NNLS when given."""
    scale = 1.0 / y
    a_rows = w * scale[:, None]
    if extra is not None:
        a_rows = np.hstack([a_rows, extra * scale[:, None]])
    centre = np.argmax(np.abs(pen), axis=1)  # each curvature row's own node (coefficient 1)
    floor = 0.1 * float(np.median(y))
    level = np.full(len(pen), float(np.median(y)))
    coef = np.zeros(a_rows.shape[1])
    for _ in range(2):
        p = pen * (PENALTY / level)[:, None]
        if extra is not None:
            p = np.hstack([p, np.zeros((len(p), extra.shape[1]))])
        a = np.vstack([a_rows, p])
        b = np.concatenate([np.ones(len(y)), np.zeros(len(p))])
        if extra is None:
            coef = np.maximum(np.linalg.lstsq(a, b, rcond=None)[0], 0.0)
        else:
            coef = fit(a, b).coef
        level = np.maximum(coef[centre], floor)
    return coef


# ---- decode ------------------------------------------------------------------------------------
def decode_nodes(cols: Cols, rows: np.ndarray) -> tuple[list[float], list[float]] | None:
    """Table nodes from the uniform rows among `rows` without drafts (a verify row of k drafts
    reads (context + k) / (k + 1) keys per query row: off the plain grid, it joins as a scattered
    row); None when either axis has < 2 values."""
    t = _table_mod()
    u = rows & uniform_rows(cols)
    plain = u & (cols["draft_tokens"] == 0)
    u = plain if plain.any() else u
    xs = _nodes(t.axis_values(TABLE_X, cols)[u], MAX_NODES)
    ys = _nodes(t.axis_values(TABLE_Y, cols)[u], MAX_NODES)
    if len(xs) < 2 or len(ys) < 2:
        return None
    return xs, ys


def fit_decode(
    cols: Cols,
    y: np.ndarray,
    rows: np.ndarray,
    nodes: tuple[list[float], list[float]],
    offset_fn: Callable[[dict[str, Any]], float] | None = None,
    straggler: bool = True,
) -> PiecewiseFit:
    """The decode table on `rows` (see the module docstring), with a straggler branch where
    rows with program_keys run above it (`straggler`: the decode attention kernel's split rule,
    sim.cost.splits; not a verify step's). `offset_fn(model)`: ms to add to every cell (a sweep
    that times less than a run's step; None: 0)."""
    t = _table_mod()
    xs, ys = nodes
    x_all, y_all = t.axis_values(TABLE_X, cols), t.axis_values(TABLE_Y, cols)
    w_all = t.table_weights(xs, ys, x_all, y_all)
    wx_all = t.spline_weights(xs, x_all)  # the table's no-KV column (`_no_kv`) at each row's x
    pen = _table_penalty(xs, ys)
    keys = cols["program_keys"] if "program_keys" in cols else np.zeros(len(y))
    uni = rows & uniform_rows(cols)
    other = rows & ~uniform_rows(cols)
    cand = other & (keys > 0) & straggler

    def table_on(mask: np.ndarray) -> np.ndarray:
        return _solve(w_all[mask], y[mask], pen)

    ms = table_on(uni if uni.sum() >= 4 else rows)
    pred_t = w_all @ ms
    base = wx_all @ _no_kv(ms, xs, ys)
    strag = cand & (y > STRAGGLER_START * pred_t)
    c = 0.0
    for _ in range(20):
        if strag.sum() < MIN_STRAGGLER_ROWS:
            break
        k, r, s = keys[strag], y[strag] - base[strag], 1.0 / y[strag]
        c = max(0.0, float(((k * s) * (r * s)).sum() / ((k * s) ** 2).sum()))
        new = cand & (base + c * keys > pred_t)
        ms = table_on(uni | (other & ~new))
        pred_t = w_all @ ms
        base = wx_all @ _no_kv(ms, xs, ys)
        if (new == strag).all():
            break
        strag = new
    use_strag = strag.sum() >= MIN_STRAGGLER_ROWS and c > 0
    if not use_strag:
        ms = table_on(rows)
        strag = np.zeros(len(y), bool)
    grid = ms.reshape(len(xs), len(ys))
    table = {"x": TABLE_X, "y": TABLE_Y, "xs": xs, "ys": ys, "ms": grid.tolist()}
    model: dict[str, Any] = {"table": table}
    if use_strag:
        spline = {"x": TABLE_X, "knots": xs, "ms": _no_kv(ms, xs, ys).tolist()}
        model = {"max": [model, {"spline": spline, "program_keys": c}]}
    delta = offset_fn(model) if offset_fn is not None else 0.0
    if delta:
        model = shift(model, delta)
    report = {
        "nodes": [len(xs), len(ys)],
        "rows": int(rows.sum()),
        "uniform_rows": int(uni.sum()),
        "straggler_rows": int(strag.sum()),
        "program_keys_ms": c if use_strag else None,
        "offset_ms": delta,
    }
    return PiecewiseFit(model, report, rows)


def _no_kv(ms: np.ndarray, xs: Sequence[float], ys: Sequence[float]) -> np.ndarray:
    """Per x node, the table continued linearly from its first two columns to no KV at all
    (>= 0): the step's work besides attention, the straggler branch's base."""
    g = ms.reshape(len(xs), len(ys))
    slope = (g[:, 1] - g[:, 0]) / (ys[1] - ys[0])
    return np.maximum(g[:, 0] - slope * ys[0], 0.0)


def shift(model: Mapping[str, Any], delta_ms: float) -> dict[str, Any]:
    """`model` + delta on every branch: a table's and a spline's cells, else the intercept."""
    if "max" in model:
        return {"max": [shift(b, delta_ms) for b in model["max"]]}
    out = dict(model)
    if "table" in out:
        t = dict(out["table"])
        t["ms"] = [[max(0.0, v + delta_ms) for v in row] for row in t["ms"]]
        out["table"] = t
    elif "spline" in out:
        s = dict(out["spline"])
        s["ms"] = [max(0.0, v + delta_ms) for v in s["ms"]]
        out["spline"] = s
    else:
        out["intercept"] = out.get("intercept", 0.0) + delta_ms
    return out


# ---- mixed -------------------------------------------------------------------------------------
def mixed_knots(cols: Cols, rows: np.ndarray) -> list[float] | None:
    """Log-spaced knots over the rows' num_tokens (integers, distinct); None below 3 values."""
    v = np.unique(cols["num_tokens"][rows])
    if len(v) < 3:
        return None
    k = np.unique(np.round(np.geomspace(v[0], v[-1], min(MAX_KNOTS, len(v)))))
    return [float(x) for x in k] if len(k) >= 2 else None


def fit_mixed(
    cols: Cols, y: np.ndarray, rows: np.ndarray, knots: list[float], terms: Sequence[str]
) -> PiecewiseFit:
    """A spline in num_tokens + non-negative linear `terms` (those that add information)."""
    t = _table_mod()
    w = t.spline_weights(knots, cols["num_tokens"][rows])
    lin: list[str] = []
    cols_in = [w]
    rank = numeric_rank(w)  # knots no row reaches add no rank: compare with the rank so far
    for f in terms:
        if f in ("intercept", "num_tokens") or f not in cols or not np.any(cols[f][rows]):
            continue
        trial = np.column_stack([*cols_in, cols[f][rows]])
        if numeric_rank(trial) == rank + 1:
            cols_in.append(cols[f][rows][:, None])
            lin.append(f)
            rank += 1
    extra = np.hstack(cols_in[1:]) if lin else np.zeros((int(rows.sum()), 0))
    coef = _solve(w, y[rows], _curvature(knots), extra)
    nk = len(knots)
    model: dict[str, Any] = {"spline": {"x": "num_tokens", "knots": knots, "ms": []}}
    model["spline"]["ms"] = [float(max(v, 0.0)) for v in coef[:nk]]
    for f, c in zip(lin, coef[nk:].tolist()):
        if c > 0:
            model[f] = c
    report = {"knots": len(knots), "rows": int(rows.sum()), "terms": lin}
    return PiecewiseFit(model, report, rows)


# ---- held-back points ----------------------------------------------------------------------------
def decode_hold(cols: Cols, rows: np.ndarray, nodes: tuple[list[float], list[float]]):
    """Rows held back: uniform rows on interior nodes (i, j) with i % HOLD_EVERY == 1 and
    j % HOLD_EVERY == 1 (their neighbours stay in), and every HOLD_EVERY-th row off the nodes."""
    t = _table_mod()
    xs, ys = nodes
    x, yv = t.axis_values(TABLE_X, cols), t.axis_values(TABLE_Y, cols)
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
