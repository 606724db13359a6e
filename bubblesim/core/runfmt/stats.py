"""The one percentile definition used everywhere in a run, and distribution summaries.

Definition (numpy's default, `method="linear"`, Hyndman & Fan type 7): for n sorted values
x[0..n-1] and a quantile q, let h = (n - 1) * q; the quantile is
x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]).
Weighted data (a value that stands for w equal samples) uses the same definition on the
expanded multiset, without expanding it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

PERCENTILE_METHOD: Literal["linear"] = "linear"
QUANTILES: dict[str, float] = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
DIST_KEYS: tuple[str, ...] = (*QUANTILES, "mean")

FloatArray = npt.NDArray[np.float64]


def dist(values: Iterable[float] | FloatArray) -> dict[str, float | None]:
    """{p50, p90, p99, mean} of the finite values; all None when there are none."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return dict.fromkeys(DIST_KEYS)
    qs = np.quantile(v, list(QUANTILES.values()), method=PERCENTILE_METHOD)
    out: dict[str, float | None] = {k: float(x) for k, x in zip(QUANTILES, qs)}
    out["mean"] = float(v.mean())
    return out


def weighted_quantiles(
    values: FloatArray, weights: npt.NDArray[Any], qs: Iterable[float]
) -> FloatArray:
    """Quantiles (the linear definition) of the multiset where values[i] occurs weights[i] times.

    Exactly equal to `np.quantile(np.repeat(values, weights), qs)`; weights are integers >= 0.
    """
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.int64)
    keep = w > 0
    v, w = v[keep], w[keep]
    q = np.asarray(list(qs), dtype=np.float64)
    if v.size == 0:
        return np.full(q.shape, np.nan)
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(w[order])
    n = int(cum[-1])
    h = (n - 1) * q
    lo = np.floor(h)
    hi = np.minimum(lo + 1, n - 1)
    # the value of 0-based rank r is the first value whose cumulative count exceeds r
    x_lo = v[np.searchsorted(cum, lo, side="right")]
    x_hi = v[np.searchsorted(cum, hi, side="right")]
    out: FloatArray = x_lo + (h - lo) * (x_hi - x_lo)
    return out
