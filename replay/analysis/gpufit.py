"""Piecewise GPU pass fits from a shape sweep: the decode table (and the shared solve).

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
  Where decode graphs padded the rows to their buckets the table steps there
  (replay.analysis.graphsteps: extra x nodes and a penalty cut).
- mixed: replay.analysis.mixedfit (a spline in num_tokens through the same penalised solve).
Rows are weighted by 1 / measured ms (relative error: a 1 ms decode and a 40 ms prefill count
alike). replay.analysis.heldback chooses the grid points a refit leaves out and scores its
predictions.

numpy only (the GPU host has no scipy or polars).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from replay.analysis.graphsteps import Segment, with_steps
from replay.analysis.lsq import fit
from sim.cost import table as cost_table

Cols = Mapping[str, np.ndarray]

TABLE_X, TABLE_Y = "num_tokens", "kv_per_token"
MAX_NODES = 24  # per axis; more distinct values are thinned (log-spaced, ends kept)
MAX_STEP_NODES = 96  # x nodes of a table with graph padding steps (each bucket and midpoint)
NODE_MERGE = 0.05  # values within 5 % of a node are one node (rows between nodes interpolate)
PENALTY = 0.05  # weight of a cell's curvature, relative to one row's relative error
BREAK_WEIGHT = 0.01  # of a curvature row across a graph step (replay.analysis.graphsteps), relative
STRAGGLER_START = 1.05  # rows this far above the table seed the straggler fit
MIN_STRAGGLER_ROWS = 2  # c is one number: two rows that straggle clearly pin it


class TableNodes(NamedTuple):
    xs: list[float]  # num_tokens
    ys: list[float]  # kv_per_token
    breaks: list[float] = []  # xs that start a padded graph segment (replay.analysis.graphsteps)


@dataclass
class PiecewiseFit:
    model: dict[str, Any]  # the gpu_pass model (profile format)
    report: dict[str, Any]  # what the fit found (nodes, straggler c, offsets)
    rows: np.ndarray  # bool: the rows it was fitted on


def table_rule() -> Any:
    """sim.cost.table, the profile format's interpolation rule."""
    return cost_table


# ---- nodes -------------------------------------------------------------------------------------
def nodes_of(values: np.ndarray, most: int, merge: bool = True) -> list[float]:
    """The distinct values (with `merge`, those within NODE_MERGE of the previous kept one merge
    into it), thinned to `most` (log-spaced picks, first and last kept)."""
    v = np.unique(values[np.isfinite(values)])
    if len(v) > 1 and merge:
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


def curvature(nodes: Sequence[float], breaks: Sequence[float] = ()) -> np.ndarray:
    """(n-2, n) rows: node i minus the linear interpolation of nodes i-1 and i+1; a row whose
    three nodes straddle a break (a node in `breaks` after the first of them) weighs
    BREAK_WEIGHT: the step there costs almost nothing, yet a column with few rows of its own
    between two breaks (a bucket a budget cut left one row of) still follows its neighbours."""
    n = len(nodes)
    out = np.zeros((max(n - 2, 0), n))
    cut = set(breaks)
    for i in range(1, n - 1):
        h1, h2 = nodes[i] - nodes[i - 1], nodes[i + 1] - nodes[i]
        w = BREAK_WEIGHT if nodes[i] in cut or nodes[i + 1] in cut else 1.0
        out[i - 1, i - 1 : i + 2] = (-w * h2 / (h1 + h2), w, -w * h1 / (h1 + h2))
    return out


def _table_penalty(
    xs: Sequence[float], ys: Sequence[float], breaks: Sequence[float] = ()
) -> np.ndarray:
    nx, ny = len(xs), len(ys)
    cx, cy = curvature(xs, breaks), curvature(ys)
    rows = [np.kron(cx, np.eye(ny)), np.kron(np.eye(nx), cy)]
    return (
        np.vstack([r for r in rows if r.size])
        if any(r.size for r in rows)
        else np.zeros((0, nx * ny))
    )


def solve(w: np.ndarray, y: np.ndarray, pen: np.ndarray, extra: np.ndarray | None = None):
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
def decode_nodes(
    cols: Cols, rows: np.ndarray, segments: Sequence[Segment] = ()
) -> TableNodes | None:
    """Table nodes from the uniform rows among `rows` without drafts (a verify row of k drafts
    reads (context + k) / (k + 1) keys per query row: off the plain grid, it joins as a scattered
    row); None when either axis has < 2 values. With padded graph `segments`
    (replay.analysis.graphsteps) the x nodes are the rows' own values, unmerged (a midpoint 2 %
    from its bucket is another segment's node), plus each segment's first x."""
    t = table_rule()
    u = rows & uniform_rows(cols)
    plain = u & (cols["draft_tokens"] == 0)
    u = plain if plain.any() else u
    xv = t.axis_values(TABLE_X, cols)[u]
    xs = nodes_of(xv, MAX_STEP_NODES, merge=False) if segments else nodes_of(xv, MAX_NODES)
    ys = nodes_of(t.axis_values(TABLE_Y, cols)[u], MAX_NODES)
    if len(xs) < 2 or len(ys) < 2:
        return None
    xs, breaks = with_steps(xs, segments)
    return TableNodes(xs, ys, breaks)


def fit_decode(
    cols: Cols,
    y: np.ndarray,
    rows: np.ndarray,
    nodes: TableNodes,
    offset_fn: Callable[[dict[str, Any]], float] | None = None,
    straggler: bool = True,
) -> PiecewiseFit:
    """The decode table on `rows` (see the module docstring), with a straggler branch where
    rows with program_keys run above it (`straggler`: the decode attention kernel's split rule,
    sim.cost.splits; not a verify step's). `offset_fn(model)`: ms to add to every cell (a sweep
    that times less than a run's step; None: 0)."""
    t = table_rule()
    xs, ys, breaks = nodes
    mask = rows
    cols = {k: v[mask] for k, v in cols.items()}  # from here on: the fit's rows only
    y = y[mask]
    rows = np.ones(len(y), bool)
    x_all, y_all = t.axis_values(TABLE_X, cols), t.axis_values(TABLE_Y, cols)
    w_all = t.table_weights(xs, ys, x_all, y_all)
    wx_all = t.spline_weights(xs, x_all)  # the table's no-KV column (`_no_kv`) at each row's x
    pen = _table_penalty(xs, ys, breaks)
    keys = cols["program_keys"] if "program_keys" in cols else np.zeros(len(y))
    uni = uniform_rows(cols)
    other = ~uni
    cand = other & (keys > 0) & straggler

    def table_on(mask: np.ndarray) -> np.ndarray:
        return solve(w_all[mask], y[mask], pen)

    ms = table_on(uni if uni.sum() >= 4 else rows)
    pred_t = w_all @ ms
    c = 0.0
    base_nodes = _base(ms, xs, ys, x_all, uni & (keys > 0), pred_t - c * keys, breaks)
    base = wx_all @ base_nodes
    strag = cand & (y > STRAGGLER_START * pred_t)
    for _ in range(20):
        if strag.sum() < MIN_STRAGGLER_ROWS:
            break
        k, r, s = keys[strag], y[strag] - base[strag], 1.0 / y[strag]
        c = max(0.0, float(((k * s) * (r * s)).sum() / ((k * s) ** 2).sum()))
        new = cand & (base + c * keys > pred_t)
        ms = table_on(uni | (other & ~new))
        pred_t = w_all @ ms
        base_nodes = _base(ms, xs, ys, x_all, uni & (keys > 0), pred_t - c * keys, breaks)
        base = wx_all @ base_nodes
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
        spline = {"x": TABLE_X, "knots": xs, "ms": base_nodes.tolist()}
        model = {"max": [model, {"spline": spline, "program_keys": c}]}
    delta = offset_fn(model) if offset_fn is not None else 0.0
    if delta:
        model = shift(model, delta)
    report = {
        "nodes": [len(xs), len(ys)],
        "graph_steps": len(breaks),
        "rows": int(rows.sum()),
        "uniform_rows": int(uni.sum()),
        "straggler_rows": int(strag.sum()),
        "program_keys_ms": c if use_strag else None,
        "offset_ms": delta,
    }
    return PiecewiseFit(model, report, mask)


def _no_kv(ms: np.ndarray, xs: Sequence[float], ys: Sequence[float]) -> np.ndarray:
    """Per x node, the table continued linearly from its first two columns to no KV at all
    (>= 0): the step's work besides attention, where those columns stream KV."""
    g = ms.reshape(len(xs), len(ys))
    slope = (g[:, 1] - g[:, 0]) / (ys[1] - ys[0])
    return np.maximum(g[:, 0] - slope * ys[0], 0.0)


def _base(
    ms: np.ndarray,
    xs: Sequence[float],
    ys: Sequence[float],
    x: np.ndarray,
    uni: np.ndarray,
    rest: np.ndarray,
    breaks: Sequence[float] = (),
) -> np.ndarray:
    """The straggler branch's base per x node: `_no_kv`, but at most the table minus c x
    program_keys on each uniform row on that node (`rest` = table - c x keys per row). A
    uniform step runs max(KV stream, base + c x keys) too, so the table bounds the base from
    above; where a small batch of short contexts sits on its longest program's floor (one
    tile of keys), the first columns are flat and `_no_kv` alone continues them to a base
    with that floor in it (the branch then ran 4.5 % above 2-row batches of 64-256 keys).
    A graph step's first node (`breaks`, no rows) continues its segment's next two nodes
    linearly, as the table's own cells there do."""
    out = _no_kv(ms, xs, ys)
    node = np.searchsorted(np.asarray(xs), x)
    on = uni & (node < len(xs))
    on &= np.isclose(np.asarray(xs)[np.minimum(node, len(xs) - 1)], x)
    cap = np.full(len(xs), np.inf)
    if on.any():
        np.minimum.at(cap, node[on], rest[on])
        out = np.maximum(np.minimum(out, cap), 0.0)
    cut = set(breaks)
    for i in range(len(xs) - 2):
        if xs[i] in cut and cap[i] == np.inf and xs[i + 1] not in cut and xs[i + 2] not in cut:
            slope = (out[i + 2] - out[i + 1]) / (xs[i + 2] - xs[i + 1])
            out[i] = max(out[i + 1] - slope * (xs[i + 1] - xs[i]), 0.0)
    return out


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
