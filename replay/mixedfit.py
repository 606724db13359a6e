"""The mixed-step GPU pass from a shape sweep: a linear spline in num_tokens (hat functions at the
rows' own values) plus linear attention terms, non-negative, through replay.gpufit's penalised
relative least squares (each knot's departure from its neighbours' line is penalised). numpy
only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from replay.gpufit import MAX_NODES, Cols, PiecewiseFit, curvature, nodes_of, solve, table_rule
from replay.lsq import numeric_rank


def mixed_knots(cols: Cols, rows: np.ndarray) -> list[float] | None:
    """Knots at the rows' own num_tokens values (as table nodes: merged within NODE_MERGE,
    thinned log-spaced to MAX_NODES); None below 3 values. Knots at sampled values, not on a
    fixed log grid: the sweep's prefill axis steps by sqrt 2, and a GEMM knee between two
    fixed knots (e.g. 128 and 256) bent the spline 6 % above the points between them."""
    v = np.unique(cols["num_tokens"][rows])
    if len(v) < 3:
        return None
    k = nodes_of(v, MAX_NODES)
    return k if len(k) >= 2 else None


def fit_mixed(
    cols: Cols, y: np.ndarray, rows: np.ndarray, knots: list[float], terms: Sequence[str]
) -> PiecewiseFit:
    """A spline in num_tokens + non-negative linear `terms` (those that add information)."""
    t = table_rule()
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
    coef = solve(w, y[rows], curvature(knots), extra)
    nk = len(knots)
    model: dict[str, Any] = {"spline": {"x": "num_tokens", "knots": knots, "ms": []}}
    model["spline"]["ms"] = [float(max(v, 0.0)) for v in coef[:nk]]
    for f, c in zip(lin, coef[nk:].tolist()):
        if c > 0:
            model[f] = c
    report = {"knots": len(knots), "rows": int(rows.sum()), "terms": lin}
    return PiecewiseFit(model, report, rows)
