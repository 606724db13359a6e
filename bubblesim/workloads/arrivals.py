"""Arrival processes: inter-arrival times at a given rate (req/s) and coefficient of variation.

Renewal processes only (independent gaps): `poisson` (exponential gaps, CV 1), `gamma` and
`weibull` (CV as asked, the same mean), `fixed` (constant gap 1/rate, CV 0) and `burst` (every
request at t = 0). Every trace starts with a request at t = 0.
"""

from __future__ import annotations

import math

import numpy as np

from bubblesim.core.cli import UsageError

ARRIVALS = ("poisson", "gamma", "weibull", "fixed", "burst")


def weibull_shape(cv: float) -> float:
    """The Weibull shape k whose coefficient of variation is `cv` (bisection on log k).
    CV(k)^2 = Gamma(1 + 2/k) / Gamma(1 + 1/k)^2 - 1 falls monotonically in k."""

    def cv_of(k: float) -> float:
        return math.sqrt(math.exp(math.lgamma(1 + 2 / k) - 2 * math.lgamma(1 + 1 / k)) - 1)

    lo, hi = math.log(0.05), math.log(500.0)  # CV ~ 1.4e4 .. 0.003
    if not cv_of(math.exp(hi)) <= cv <= cv_of(math.exp(lo)):
        raise UsageError(f"--cv {cv}: outside what a Weibull can reach")
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cv_of(math.exp(mid)) > cv else (lo, mid)
    return math.exp((lo + hi) / 2)


def gaps(rng: np.random.Generator, kind: str, rate: float, cv: float, n: int) -> np.ndarray:
    """n inter-arrival gaps in seconds, mean 1/rate (0 for `burst`)."""
    if kind not in ARRIVALS:
        raise UsageError(f"--arrival {kind!r}: must be one of {', '.join(ARRIVALS)}")
    if kind == "burst":
        return np.zeros(n)
    if not (rate > 0 and math.isfinite(rate)):
        raise UsageError(f"--rate {rate}: must be > 0 requests per second")
    mean = 1.0 / rate
    if kind == "fixed":
        return np.full(n, mean)
    if kind == "poisson":
        return rng.exponential(mean, n)
    if not (cv > 0 and math.isfinite(cv)):
        raise UsageError(f"--cv {cv}: must be > 0 for {kind} arrivals")
    if kind == "gamma":
        shape = 1.0 / cv**2
        return rng.gamma(shape, mean / shape, n)
    k = weibull_shape(cv)
    return rng.weibull(k, n) * (mean / math.gamma(1 + 1 / k))


def arrival_times(
    rng: np.random.Generator,
    kind: str,
    rate: float,
    cv: float = 1.0,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> np.ndarray:
    """Arrival times (s) from 0: exactly `num_requests`, or every arrival before `duration_s`."""
    if (num_requests is None) == (duration_s is None):
        raise UsageError("give exactly one of --num-requests and --duration-s")
    if num_requests is not None:
        if num_requests < 1:
            raise UsageError(f"--num-requests {num_requests}: must be >= 1")
        return np.concatenate([[0.0], np.cumsum(gaps(rng, kind, rate, cv, num_requests - 1))])
    assert duration_s is not None
    if not duration_s > 0:
        raise UsageError(f"--duration-s {duration_s}: must be > 0")
    if kind == "burst":
        raise UsageError("--arrival burst needs --num-requests, not --duration-s")
    times = [np.zeros(1)]
    t, batch = 0.0, max(16, int(duration_s * rate * 1.1) + 16)
    while t < duration_s:  # draw in batches: a few draws at most, whatever the CV
        more = t + np.cumsum(gaps(rng, kind, rate, cv, batch))
        times.append(more)
        t = float(more[-1])
    out = np.concatenate(times)
    return out[out < duration_s]
