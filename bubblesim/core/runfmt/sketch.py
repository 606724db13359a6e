"""A deterministic quantile sketch for inter-token latencies of millions of tokens.

`LogHistogram` is a fixed log-bucket histogram (the DDSketch mapping): a positive value x falls
in bucket i = ceil(ln(x) / ln(gamma)) with gamma = (1 + a) / (1 - a), and the bucket stands for
2 * gamma**i / (gamma + 1), which is within relative error `a` of every value in the bucket.
Quantiles use the linear definition of `stats.py` over the bucket representatives, so each
order statistic, and hence each interpolated quantile, is within relative error `a` of the exact
one (a = 0.1 % by default). Zeros have their own exact bucket; values outside [min_s, max_s]
are clamped to the range. Same inputs give the same counts in any order (sums of integers).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from bubblesim.core.runfmt.stats import FloatArray, weighted_quantiles


class LogHistogram:
    def __init__(self, rel_err: float = 1e-3, min_s: float = 1e-9, max_s: float = 1e6) -> None:
        if not (0 < rel_err < 1 and 0 < min_s < max_s):
            raise ValueError("LogHistogram needs 0 < rel_err < 1 and 0 < min_s < max_s")
        self.rel_err = rel_err
        self.min_s, self.max_s = min_s, max_s
        self._ln_gamma = math.log((1 + rel_err) / (1 - rel_err))
        self._i_min = math.ceil(math.log(min_s) / self._ln_gamma)
        i_max = math.ceil(math.log(max_s) / self._ln_gamma)
        # slot 0 counts zeros; slot 1 + (i - i_min) counts bucket i
        self._counts = np.zeros(i_max - self._i_min + 2, dtype=np.int64)

    @property
    def count(self) -> int:
        return int(self._counts.sum())

    def add(self, values: FloatArray, weights: npt.NDArray[Any] | None = None) -> None:
        """Count values[i] weights[i] times (weights default to 1); values must be >= 0."""
        v = np.asarray(values, dtype=np.float64)
        w = np.ones(v.shape, np.int64) if weights is None else np.asarray(weights, np.int64)
        if v.size and not (np.all(v >= 0) and np.all(w >= 0)):
            raise ValueError("LogHistogram.add: values and weights must be >= 0 (and not NaN)")
        pos = v > 0
        slot = np.zeros(v.shape, dtype=np.int64)
        clamped = np.clip(v[pos], self.min_s, self.max_s)
        slot[pos] = np.ceil(np.log(clamped) / self._ln_gamma).astype(np.int64) - self._i_min + 1
        slot = np.clip(slot, 0, self._counts.size - 1)  # guards float rounding at the edges
        self._counts += np.bincount(slot, weights=w, minlength=self._counts.size).astype(np.int64)

    def merge(self, other: LogHistogram) -> None:
        """Add every count of `other` (same rel_err, min_s and max_s) to this histogram: the
        same counts as adding other's values here."""
        if (other.rel_err, other.min_s, other.max_s) != (self.rel_err, self.min_s, self.max_s):
            raise ValueError("LogHistogram.merge: the histograms differ in rel_err/min_s/max_s")
        self._counts += other._counts

    def representatives(self) -> FloatArray:
        i = np.arange(self._counts.size - 1, dtype=np.float64) + self._i_min
        gamma = math.exp(self._ln_gamma)
        reps = 2.0 * np.exp(i * self._ln_gamma) / (gamma + 1.0)
        return np.concatenate(([0.0], reps))

    def quantiles(self, qs: Iterable[float]) -> FloatArray:
        nz = np.flatnonzero(self._counts)
        return weighted_quantiles(self.representatives()[nz], self._counts[nz], qs)
