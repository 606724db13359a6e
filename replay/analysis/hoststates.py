"""The host's two speed states, read from a run's binned log host speed.

On the H100 and H200 hosts the steps' log host speed (replay.analysis.hostspeed.step_log_speeds),
averaged over 0.1 s bins, is bimodal: a fast state and a slow one about 1.75 x slower, with
slow stretches of 0.3-2 s; a run's level against the profile is mostly the share of its time in
the slow state (reports/fidelity/README.md section L). `two_states` fits a two-normal mixture
to such bins by EM; `slow_stretches` reads the lengths of the slow stretches of a classification.
reports/fidelity/host_states.py prints them per run.

`fit_host_states` (replay calibrate --host-states) makes the profile's `host_speed.states`
(sim.cost.hostspeed) from the calibration runs, each fitted alone (a spec run's phases can sit
at another level against the profile than a plain run's, which would blur the pooled bins);
the runs whose bins show two states (MIN_D_BIC) give slow_over_fast = exp of their slow mean
less their fast mean (weighted by bins); each bin is classified by its posterior, and each state's
time over the switches out of it seen between consecutive bins with steps is its mean dwell
time (slow_s, fast_s: the exponential's maximum-likelihood mean, which a stretch cut by an idle
gap or a run's end does not shorten). Within a state
the host still wanders: each step's log speed less its bin's state mean goes through the same
Ornstein-Uhlenbeck fit as without states (replay.analysis.hostspeed.fit_ou), whose processes
multiply the states'. Each step's estimated speed (for the spread around it) is its state's
multiplier times the processes' shrunk estimate, relative to its run's mean. Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from bubblesim.core.runfmt import Run
from replay.analysis.hostspeed import (
    BIN_S as OU_BIN_S,
)
from replay.analysis.hostspeed import (
    MAX_LAG_S,
    SpeedSeries,
    autocovariance,
    binned,
    fit_processes,
    speed_estimate,
    step_log_speeds,
)
from replay.analysis.steps import Steps

BIN_S = 0.1  # the bins the states are read from
EM_ITERS = 300
MIN_SD = 0.02  # a component's sd floor (log speed): a state is never a point
MIN_BINS = 20  # fewer bins: no fit (the report says so)
MIN_D_BIC = 10.0  # the mixture must beat one normal by this much (BIC) to be fitted


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
    one_sd = np.array([max(float(x.std()), MIN_SD)])  # floored as a component's: a steady host
    ll1 = float(_normal_loglik(x, np.ones(1), np.array([x.mean()]), one_sd).sum())
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


def _bin_index(series: SpeedSeries, bin_s: float) -> np.ndarray:
    return (series.t_s // bin_s).astype(np.int64)


def _exits(slow: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """Switches out of the fast and out of the slow state between consecutive bins with steps.
    With time in each state, they give the dwell times' maximum-likelihood means under
    censoring (a stretch cut by a run's end or an idle gap counts its time, not an exit)."""
    both = ok[:-1] & ok[1:]
    a, b = slow[:-1][both], slow[1:][both]
    return np.array([int((~a & b).sum()), int((a & ~b).sum())], np.int64)


def fit_host_states(
    prof: Mapping[str, Any], runs: Sequence[Run], steps: Steps, notes: list[str]
) -> tuple[dict[str, Any] | None, np.ndarray, dict[str, Any]]:
    """(`host_speed`'s states and, within them, sigma and tau_s, or None; each step's estimated
    speed (1 where none); a report) for a resolved profile (module docstring)."""
    series = step_log_speeds(prof, runs, steps)
    speed = np.ones(len(steps))
    report: dict[str, Any] = {"bin_s": BIN_S, "runs": {}}
    log_ratios, weights, residual = [], [], []
    time_s = np.zeros(2)  # seconds in the fast and the slow state
    exits = np.zeros(2, np.int64)  # switches out of each, seen between two bins with steps
    for run, s in zip(runs, series, strict=True):
        b = binned(s, BIN_S)[0]
        ok = np.isfinite(b)
        mix = two_states(b[ok]) if ok.sum() >= MIN_BINS else None
        name = str(run.path).rstrip("/").rsplit("/", 1)[-1]
        report["runs"][name] = (
            {"bins": int(ok.sum())} if mix is None
            else {"bins": int(ok.sum()), "mean": list(mix.mean), "sd": list(mix.sd),
                  "weight_slow": mix.weight_slow, "d_bic": mix.d_bic}
        )  # fmt: skip
        if mix is None or mix.d_bic < MIN_D_BIC:  # one state: its wander only
            residual.append(replace(s, log_speed=s.log_speed - s.log_speed.mean()))
            continue
        slow_bin = mix.slow_posterior(np.where(ok, b, mix.mean[0])) > 0.5
        log_ratios.append(mix.mean[1] - mix.mean[0])
        weights.append(float(ok.sum()))
        time_s += BIN_S * np.array([(ok & ~slow_bin).sum(), (ok & slow_bin).sum()])
        exits += _exits(slow_bin, ok)
        state_mean = np.where(slow_bin, mix.mean[1], mix.mean[0])[_bin_index(s, BIN_S)]
        residual.append(replace(s, log_speed=s.log_speed - state_mean))
    if exits.min() == 0:
        notes.append(f"host_speed.states: no run's {BIN_S} s bins show two states (a mixture "
                     f"{MIN_D_BIC:g} better in BIC than one normal, with both visited): "
                     "not fitted")  # fmt: skip
        return None, speed, report
    states = {
        "slow_over_fast": round(math.exp(float(np.average(log_ratios, weights=weights))), 6),
        "fast_s": round(float(time_s[0] / exits[0]), 6),
        "slow_s": round(float(time_s[1] / exits[1]), 6),
    }
    report.update(states=states, fast_exits=int(exits[0]), slow_exits=int(exits[1]),
                  two_state_runs=len(log_ratios))  # fmt: skip
    # the wander within a state: the same fit as without states, on the residual
    cov, pairs = autocovariance([binned(r)[0] for r in residual], int(round(MAX_LAG_S / OU_BIN_S)))
    comps, var, step_var, _ = fit_processes(cov, pairs, residual)  # two-state runs have bins
    report.update(sigma=[sg for sg, _ in comps], tau_s=[t for _, t in comps],
                  step_sd=float(np.sqrt(step_var)))  # fmt: skip
    for s, r in zip(series, residual, strict=True):
        if not s.t_s.size:
            continue
        state = s.log_speed - r.log_speed  # the step's state mean (its run's mean: one state)
        within = speed_estimate(r, float(np.sqrt(var)), step_var) if comps else 1.0
        speed[s.rows] = np.exp(state - state.mean()) * within
    fit: dict[str, Any] = {"states": states}
    if comps:
        fit["sigma"] = [round(sg, 6) for sg, _ in comps]
        fit["tau_s"] = [round(t, 6) for _, t in comps]
    return fit, speed, report


def describe_host_states(report: Mapping[str, Any]) -> str:
    """One line for calibrate's notes."""
    st = report["states"]
    within = ", ".join(
        f"sd {s:.3f} tau {t:.2f} s" for s, t in zip(report["sigma"], report["tau_s"], strict=True)
    )
    return (
        f"host_speed.states: slow {st['slow_over_fast']:.3f} x fast, stretches of "
        f"{st['fast_s']:.2f} s fast / {st['slow_s']:.2f} s slow on average "
        f"({report['fast_exits']} / {report['slow_exits']} exits) in the {report['bin_s']} s "
        f"bins of the {report['two_state_runs']} of {len(report['runs'])} runs that show two "
        f"states; within a state: {within or 'no process'}, the steps' own sd "
        f"{report['step_sd']:.3f}"
    )
