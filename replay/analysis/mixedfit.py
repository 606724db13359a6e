"""The mixed-step GPU pass from a shape sweep: a linear spline in num_tokens (hat functions at the
rows' own values; the GEMMs, whose efficiency steps with the token count) plus non-negative
linear attention terms, through replay.analysis.gpufit's penalised relative least squares (each
knot's departure from its neighbours' line is penalised).

Where the sweep holds steps whose attention waits on one long program (sim.cost.mixedsplits:
a short chunk after a long context runs a few programs that each walk all of it; a long decode
row beside a chunk walks its context in at most 8 splits), the model is the larger of two
branches sharing the spline (`{"max": [...]}`):
  throughput: spline + attn_pairs, kv_read_tokens, grid_blocks, chunk_spread, ... (the fit's
              `terms`)
  straggler:  spline + mixed_keys (the longest program's keys), kv_read_tokens, num_reqs
fitted together: each row joins the branch that is the larger at the current coefficients
(rows > STRAGGLER_START x the throughput branch seed the straggler branch), one penalised
solve of both branches' terms over the shared spline, until no row changes branch. On the
H100 sweep of llama3.2-1b the single branch missed a 64-token chunk after 131k of context
by 64 % (held back) and 255 decode rows beside an 8k chunk by 18 %. numpy only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from replay.analysis.gpufit import (
    MAX_NODES,
    Cols,
    PiecewiseFit,
    curvature,
    nodes_of,
    solve,
    table_rule,
)
from replay.analysis.lsq import numeric_rank


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


GRID_TERM = "grid_blocks"  # joins the throughput branch's terms where the columns hold it
SPREAD_TERM = "chunk_spread"  # likewise (sim.cost.mixedsplits.chunk_spread)
KEYS_TERM = "mixed_keys"
STRAGGLER_TERMS = (KEYS_TERM, "kv_read_tokens", "num_reqs")
STRAGGLER_START = 1.05  # rows this far above the throughput branch seed the straggler branch
MIN_STRAGGLER_ROWS = 2
MAX_ROUNDS = 20


def _independent(cols: Cols, rows: np.ndarray, w: np.ndarray, terms: Sequence[str]) -> list[str]:
    """The `terms` (shape columns) that add rank to the spline weights `w`, in order."""
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
    return lin


def fit_mixed(
    cols: Cols, y: np.ndarray, rows: np.ndarray, knots: list[float], terms: Sequence[str]
) -> PiecewiseFit:
    """A spline in num_tokens + non-negative linear `terms` (those that add information), and
    the straggler branch where rows run on their longest program (module docstring)."""
    t = table_rule()
    w = t.spline_weights(knots, cols["num_tokens"][rows])
    yr = y[rows]
    lin = _independent(cols, rows, w, [*terms, GRID_TERM, SPREAD_TERM])
    x1 = _columns(cols, rows, lin)
    nk = len(knots)
    pen = curvature(knots)
    coef = solve(w, yr, pen, x1)
    report: dict[str, Any] = {"knots": nk, "rows": int(rows.sum()), "terms": lin}
    keys = cols[KEYS_TERM][rows] if KEYS_TERM in cols else np.zeros(len(yr))
    strag = (keys > 0) & (yr > STRAGGLER_START * (w @ coef[:nk] + x1 @ coef[nk:]))
    lin2 = [f for f in STRAGGLER_TERMS if f in cols]
    x2 = _columns(cols, rows, lin2)
    both = coef
    for _ in range(MAX_ROUNDS):
        if strag.sum() < MIN_STRAGGLER_ROWS:
            break
        both = solve(w, yr, pen, np.hstack([x1 * ~strag[:, None], x2 * strag[:, None]]))
        c1, c2 = both[nk : nk + len(lin)], both[nk + len(lin) :]
        spline = w @ both[:nk]
        new = (keys > 0) & (spline + x2 @ c2 > spline + x1 @ c1) & (c2[0] > 0)
        if (new == strag).all():
            break
        strag = new
    if strag.sum() < MIN_STRAGGLER_ROWS or both is coef:
        report["straggler_rows"] = 0
        return PiecewiseFit(_branch(knots, coef[:nk], lin, coef[nk:]), report, rows)
    c1, c2 = both[nk : nk + len(lin)], both[nk + len(lin) :]
    model = {
        "max": [_branch(knots, both[:nk], lin, c1), _branch(knots, both[:nk], lin2, c2)]
    }  # fmt: skip
    report.update(straggler_rows=int(strag.sum()), straggler_terms=lin2)
    report["mixed_keys_us"] = float(c2[0]) * 1e3
    return PiecewiseFit(model, report, rows)


def _columns(cols: Cols, rows: np.ndarray, names: Sequence[str]) -> np.ndarray:
    if not names:
        return np.zeros((int(rows.sum()), 0))
    return np.column_stack([np.asarray(cols[f][rows], np.float64) for f in names])


def _branch(
    knots: list[float], ms: np.ndarray, names: Sequence[str], coef: np.ndarray
) -> dict[str, Any]:
    model: dict[str, Any] = {
        "spline": {"x": "num_tokens", "knots": knots, "ms": [float(max(v, 0.0)) for v in ms]}
    }
    for f, c in zip(names, coef.tolist()):
        if c > 0:
            model[f] = c
    return model
