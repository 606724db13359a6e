"""Non-negative least squares for cost fits: scipy.optimize.nnls when scipy is installed, else
the Lawson-Hanson active-set method below (the same algorithm; the GPU host has no scipy).

Columns are scaled to unit norm before solving (shape fields span 1 .. 1e9, e.g. attn_pairs),
which leaves the sign constraints unchanged; all-zero columns get a coefficient of 0.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np

_HAVE_SCIPY = importlib.util.find_spec("scipy") is not None


def nnls_lawson_hanson(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson & Hanson 1974, ch. 23)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter or 3 * n + 10):
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            # step back to the boundary: the first passive coefficient to reach 0 leaves
            neg = passive & (z <= tol)
            alpha = np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if _HAVE_SCIPY:
        from scipy.optimize import nnls as scipy_nnls  # optional dependency, present here

        return scipy_nnls(a, b, maxiter=50 * a.shape[1] + 100)[0]
    return nnls_lawson_hanson(a, b)


@dataclass(frozen=True)
class Fit:
    coef: np.ndarray  # one per column, in the input's units
    r2: float | None  # coefficient of determination (None: constant target)
    rmse: float


def fit(x: np.ndarray, y: np.ndarray, nonneg: bool = True) -> Fit:
    """Least squares of y on the columns of x; coefficients >= 0 when `nonneg`."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    norms = np.linalg.norm(x, axis=0)
    live = norms > 0
    coef = np.zeros(x.shape[1])
    if live.any() and y.size:
        xs = x[:, live] / norms[live]
        c = nnls(xs, y) if nonneg else np.linalg.lstsq(xs, y, rcond=None)[0]
        coef[live] = c / norms[live]
    resid = y - x @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum()) if y.size else 0.0
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else None
    rmse = float(np.sqrt((resid**2).mean())) if y.size else 0.0
    return Fit(coef, r2, rmse)


def numeric_rank(x: np.ndarray) -> int:
    """Rank of x after scaling columns to unit norm (so units do not decide it)."""
    norms = np.linalg.norm(x, axis=0)
    live = norms > 0
    if not live.any():
        return 0
    s = np.linalg.svd(x[:, live] / norms[live], compute_uv=False)
    return int((s > s[0] * 1e-8).sum())
