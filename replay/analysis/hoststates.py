"""The host's two speed states, read from a run's binned log host speed.

On the H100 and H200 hosts the steps' log host speed (replay.analysis.hostspeed.step_log_speeds),
averaged over 0.1 s bins, is bimodal: a fast state and a slow one about 1.75 x slower, with
slow stretches of 0.3-2 s; a run's level against the profile is mostly the share of its time in
the slow state (reports/fidelity/README.md section L). `two_states` fits a two-normal mixture
to such bins by EM; `slow_stretches` reads the lengths of the slow stretches of a classification.
reports/fidelity/host_states.py prints them per run. Pure numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BIN_S = 0.1  # the bins the states are read from
EM_ITERS = 300
MIN_SD = 0.02  # a component's sd floor (log speed): a state is never a point
MIN_BINS = 20  # fewer bins: no fit (the report says so)


@dataclass
class Mixture:
    """Two normals in log speed: the fast state (lower mean) first."""

    weight_slow: float
    mean: tuple[float, float]  # log speed, fast then slow
    sd: tuple[float, float]
    d_bic: float  # BIC(one normal) - BIC(mixture)

    def slow_posterior(self, x: np.ndarray) -> np.ndarray:
        dens = [
            w * np.exp(-0.5 * ((x - m) / s) ** 2) / s
            for w, m, s in zip((1 - self.weight_slow, self.weight_slow), self.mean, self.sd)
        ]
        total = dens[0] + dens[1]
        return np.divide(dens[1], total, out=np.full(x.shape, 0.5), where=total > 0)


def _normal_loglik(x: np.ndarray, w: np.ndarray, m: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Per point, log of sum_k w_k N(x; m_k, s_k)."""
    z = (x[:, None] - m[None, :]) / s[None, :]
    comp = np.log(w)[None, :] - 0.5 * z * z - np.log(s)[None, :] - 0.5 * math.log(2 * math.pi)
    top = comp.max(axis=1, keepdims=True)
    return (top + np.log(np.exp(comp - top).sum(axis=1, keepdims=True)))[:, 0]


def two_states(x: np.ndarray) -> Mixture:
    """EM fit of a two-normal mixture to `x` (started at its quartiles); the fast state first."""
    x = np.asarray(x, np.float64)
    m = np.percentile(x, [25, 75]).astype(np.float64)
    if m[1] - m[0] < 2 * MIN_SD:
        m = np.array([x.mean() - MIN_SD, x.mean() + MIN_SD])
    s = np.full(2, max(float(x.std()) / 2, MIN_SD))
    w = np.array([0.5, 0.5])
    for _ in range(EM_ITERS):
        z = (x[:, None] - m[None, :]) / s[None, :]
        dens = w[None, :] * np.exp(-0.5 * z * z) / s[None, :]
        r = dens / np.maximum(dens.sum(axis=1, keepdims=True), 1e-300)
        nk = np.maximum(r.sum(axis=0), 1e-12)
        w = nk / nk.sum()
        m = (r * x[:, None]).sum(axis=0) / nk
        s = np.sqrt(np.maximum((r * (x[:, None] - m[None, :]) ** 2).sum(axis=0) / nk, MIN_SD**2))
    order = np.argsort(m)
    w, m, s = w[order], m[order], s[order]
    ll2 = float(_normal_loglik(x, w, m, s).sum())
    ll1 = float(_normal_loglik(x, np.ones(1), np.array([x.mean()]), np.array([x.std()])).sum())
    n = x.size
    d_bic = (-2 * ll1 + 2 * math.log(n)) - (-2 * ll2 + 5 * math.log(n))
    return Mixture(float(w[1]), (float(m[0]), float(m[1])), (float(s[0]), float(s[1])), d_bic)


def slow_stretches(slow: np.ndarray) -> list[int]:
    """Lengths (in bins) of the runs of consecutive True in `slow`."""
    out, n = [], 0
    for v in slow.tolist():
        if v:
            n += 1
        elif n:
            out.append(n)
            n = 0
    if n:
        out.append(n)
    return out
