"""Fit of the host's slowly varying speed (profile key `host_speed`, sim.cost.hostspeed).

The measured host phases of a step run faster or slower together for a while: on the H100 host
every CPU phase of llama3.2-1b's calibration run ran at ~0.8 x its shape model for seconds, then
1.5-1.8 x for 0.5-1.5 s, whatever the batch (200-step rolling means of the six phases correlate
at 0.96-0.99), which a per-step spread drawn independently cannot make. Per step, over the
CPU phases it measured:

    log speed = log(sum of measured phase ms / sum of the fitted profile's predicted ms)

(measured less GC pauses and sync waits, replay.analysis.steps; predicted as the simulator does,
replay.analysis.quality.phase_predicted_ms). The steps' log speeds are averaged in BIN_S bins of
their start time, each run's bins less the run's mean (a run's own level is the shape model's
fit: the calibration runs it comes from cannot tell a level from a misfit), and the bins'
autocovariance at lags 1 .. MAX_LAG_S / BIN_S, pooled over the runs, is fitted by an
Ornstein-Uhlenbeck process's, sigma^2 exp(-lag / tau) (lag 0 left out: it holds the steps' own
noise, which cpu_spread draws). The phases' spread around that speed (`host_speed.cpu_spread`,
what the simulator draws per step while the host speed is on) is replay.analysis.spread's fit on
measured / (predicted x the step's estimated speed): the estimate is its bin's mean log speed
shrunk towards 0 by sigma^2 / (sigma^2 + per-step variance / steps in the bin).

The copula (`host_speed.rho`, calibrate --host-copula; sim.cost.hostspeed): per phase, rho is
the correlation between a step's normal score, Phi^-1 of its ratio's place among the phase's
measured / predicted ratios (the weighted mid-rank, weights = predicted ms as the spread table
is fitted, so the score is the u the table gives that ratio at), and the host's state at the
step estimated from the OTHER steps within COPULA_WINDOW_S of its start (their mean log speed,
shrunk as above: the step's own ratio is not in it, which a bin holding the step would put
there), weighted alike. The estimate is the state plus noise, so the correlation is
disattenuated: divided by corr(state, estimate) = sqrt(var(estimate) / sum sigma^2) (the
estimate is a posterior mean), and kept in [0, RHO_MAX]. Both are in the fit report.
Pure numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import Run
from replay.analysis.quality import phase_predicted_ms, phase_predictions
from replay.analysis.steps import Steps
from sim.cost.spread import normal_scores

BIN_S = 0.05  # the bins the steps' log speeds are averaged in
MIN_BIN_STEPS = 3  # a bin with fewer steps is left out
MAX_LAG_S = 4.0  # the autocovariance is fitted up to this lag
MIN_BINS = 200  # fewer bins over all runs: no host speed (a note says so)
TAU_GRID_S = np.geomspace(2 * BIN_S, 30.0, 120)  # the correlation times tried (a faster
# process is not resolved by the bins: the per-step spread, cpu_spread, draws it)
COMPONENTS = 2  # independent processes summed (their log speeds add)
COPULA_WINDOW_S = 0.1  # the copula's host state of a step: the other steps this close to it
COPULA_MIN_STEPS = 200  # fewer steps of a phase with an estimate: rho 0 (a note says so)
RHO_MAX = 0.95


@dataclass
class SpeedSeries:
    """One run's steps with a host-phase prediction: start times (s) and log speeds, and the
    rows of `Steps` they are."""

    t_s: np.ndarray
    log_speed: np.ndarray
    rows: np.ndarray


def step_log_speeds(
    prof: Mapping[str, Any], runs: Sequence[Run], steps: Steps,
    phases: Sequence[str] = CPU_PHASES,
) -> list[SpeedSeries]:  # fmt: skip
    """Per run, its steps' log(measured / predicted) over the CPU phases they measured (a
    resolved profile `prof`; steps whose phases predict no time are left out). `phases`: those
    summed (reports/fidelity/eager_host.py reads the host around the launch from the others)."""
    meas = np.zeros(len(steps))
    pred = np.zeros(len(steps))
    for phase in phases:
        y = steps.phase_ms[phase]
        rows = np.isfinite(y)
        if rows.any():
            meas[rows] += y[rows]
            pred[rows] += phase_predicted_ms(prof, runs, steps, phase, rows)
    out = []
    for i, run in enumerate(runs):
        rows = np.flatnonzero((steps.run == i) & (pred > 0) & (meas > 0))
        start = run.arrays("steps")["schedule_start_s"]
        t = np.asarray(start, np.float64)[rows - np.flatnonzero(steps.run == i)[0]]
        out.append(SpeedSeries(t - t[0] if t.size else t, np.log(meas[rows] / pred[rows]), rows))
    return out


def binned(series: SpeedSeries, bin_s: float = BIN_S) -> tuple[np.ndarray, np.ndarray]:
    """(mean log speed per bin of the run's start times, NaN where < MIN_BIN_STEPS steps;
    steps per bin)."""
    if not series.t_s.size:
        return np.zeros(0), np.zeros(0, np.int64)
    b = (series.t_s // bin_s).astype(np.int64)
    n = int(b.max()) + 1
    count = np.bincount(b, minlength=n)
    total = np.bincount(b, series.log_speed, n)
    mean = np.where(count >= MIN_BIN_STEPS, total / np.maximum(count, 1), np.nan)
    return mean, count


def autocovariance(bins: Sequence[np.ndarray], max_lag: int) -> tuple[np.ndarray, np.ndarray]:
    """(autocovariance at lags 0 .. max_lag, pairs at each lag) of the runs' bin series, each
    less its own mean, pooled over the runs (NaN bins left out)."""
    cov = np.zeros(max_lag + 1)
    pairs = np.zeros(max_lag + 1)
    for x in bins:
        x = x - np.nanmean(x) if np.isfinite(x).any() else x
        for k in range(min(max_lag + 1, x.size)):
            a, c = x[: x.size - k], x[k:]
            ok = np.isfinite(a) & np.isfinite(c)
            cov[k] += float(np.sum(a[ok] * c[ok]))
            pairs[k] += int(ok.sum())
    return np.where(pairs > 0, cov / np.maximum(pairs, 1), np.nan), pairs


def fit_ou(
    cov: np.ndarray, pairs: np.ndarray, bin_s: float, components: int = COMPONENTS
) -> list[tuple[float, float]]:
    """[(sigma, tau_s)] of up to `components` independent Ornstein-Uhlenbeck processes whose
    summed autocovariance, sum_j sigma_j^2 exp(-lag / tau_j), fits `cov` at lags >= 1 (least
    squares weighted by the pairs, over pairs of correlation times on TAU_GRID_S with the
    variances in closed form, kept >= 0 and summing to at most the bins' variance, cov[0]);
    shortest tau first, those with sigma 0 left out."""
    lag = np.arange(cov.size) * bin_s
    ok = (np.arange(cov.size) >= 1) & (pairs > 0) & np.isfinite(cov)
    y, w, lag = cov[ok], np.sqrt(pairs[ok]), lag[ok]
    basis = np.exp(-lag[None, :] / TAU_GRID_S[:, None]) * w  # (taus, lags)
    yw = y * w
    best: tuple[float, list[tuple[float, float]]] = (float(np.sum(yw * yw)), [])
    n = len(TAU_GRID_S)
    pairs_ij = [(i, j) for i in range(n) for j in range(i, n)] if components > 1 else []
    for i, j in [(i, i) for i in range(n)] + [p for p in pairs_ij if p[0] < p[1]]:
        a = basis[[i]] if i == j else basis[[i, j]]
        coef, *_ = np.linalg.lstsq(a.T, yw, rcond=None)
        if np.any(coef < 0) or float(np.sum(coef)) > cov[0]:
            continue
        sse = float(np.sum((yw - coef @ a) ** 2))
        if sse < best[0]:
            taus = [TAU_GRID_S[i]] if i == j else [TAU_GRID_S[i], TAU_GRID_S[j]]
            best = (sse, [(float(np.sqrt(c)), float(t)) for c, t in zip(coef, taus, strict=True)])
    return [(s, t) for s, t in best[1] if s > 0]


def speed_estimate(
    series: SpeedSeries, sigma: float, step_var: float, bin_s: float = BIN_S
) -> np.ndarray:
    """Each step's estimated speed (a multiplier, its run's mean level 1): exp of its bin's
    mean log speed less the run's, shrunk by sigma^2 / (sigma^2 + step_var / steps in bin)."""
    if not series.t_s.size:
        return np.ones(0)
    b = (series.t_s // bin_s).astype(np.int64)
    n = int(b.max()) + 1
    count = np.bincount(b, minlength=n)
    mean = np.bincount(b, series.log_speed, n) / np.maximum(count, 1)
    x = mean[b] - series.log_speed.mean()
    s2 = sigma * sigma
    shrink = s2 / (s2 + step_var / np.maximum(count[b], 1)) if s2 > 0 else np.zeros(b.size)
    return np.exp(shrink * x)


def fit_host_speed(
    prof: Mapping[str, Any], runs: Sequence[Run], steps: Steps, notes: list[str]
) -> tuple[dict[str, list[float]] | None, np.ndarray, dict[str, Any]]:
    """(`host_speed`'s sigma and tau_s lists, or None; each step's estimated speed (1 where none);
    a report: the fit, the autocovariance and, per run, the bins' autocorrelation)."""
    series = step_log_speeds(prof, runs, steps)
    bins = [binned(s)[0] for s in series]
    max_lag = int(round(MAX_LAG_S / BIN_S))
    cov, pairs = autocovariance(bins, max_lag)
    speed = np.ones(len(steps))
    nbins = int(sum(np.isfinite(b).sum() for b in bins))
    report: dict[str, Any] = {"bin_s": BIN_S, "bins": nbins, "runs": {}}
    for run, s, b in zip(runs, series, bins, strict=True):
        report["runs"][str(run.path)] = run_report(s, b)
    if nbins < MIN_BINS:
        notes.append(f"host_speed: {nbins} bins of {BIN_S} s (< {MIN_BINS}): not fitted")
        return None, speed, report
    comps, var, step_var, logs = fit_processes(cov, pairs, series)
    lags = np.arange(cov.size) * BIN_S
    model = sum((sg * sg * np.exp(-lags / tau) for sg, tau in comps), np.zeros(lags.size))
    report.update(
        sigma=[sg for sg, _ in comps], tau_s=[tau for _, tau in comps],
        step_sd=float(np.sqrt(step_var)), total_sd=float(np.std(logs)),
        lag_s=lags.tolist(), autocovariance=cov.tolist(), model=model.tolist(),
    )  # fmt: skip
    if not comps:
        notes.append("host_speed: the bins' autocovariance is not positive: not fitted")
        return None, speed, report
    for s in series:
        speed[s.rows] = speed_estimate(s, float(np.sqrt(var)), step_var)
    fit = {
        "sigma": [round(sg, 6) for sg, _ in comps],
        "tau_s": [round(tau, 6) for _, tau in comps],
    }
    return fit, speed, report


def fit_processes(
    cov: np.ndarray, pairs: np.ndarray, series: Sequence[SpeedSeries]
) -> tuple[list[tuple[float, float]], float, float, np.ndarray]:
    """The OU components fitted to the bins' autocovariance (`fit_ou`), their summed variance,
    the steps' own variance around them (the rest of the log speeds' variance, each run less
    its mean) and those log speeds: what fit_host_speed and, within a state,
    replay.analysis.hoststates.fit_host_states fit."""
    comps = fit_ou(cov, pairs, BIN_S)
    var = sum(sg * sg for sg, _ in comps)
    logs = np.concatenate([s.log_speed - s.log_speed.mean() for s in series if s.t_s.size])
    return comps, var, max(float(np.var(logs)) - var, 0.0), logs


ACF_LAGS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
MIN_PAIRS = 50


def run_report(series: SpeedSeries, bins: np.ndarray) -> dict[str, Any]:
    """One run's steps, bins, log-speed sd (steps, bins) and the bins' autocorrelation at
    ACF_LAGS_S (its own mean out; None at a lag with fewer than MIN_PAIRS pairs of bins)."""
    ok = np.isfinite(bins)
    cov, pairs = autocovariance([bins], int(round(max(ACF_LAGS_S) / BIN_S)))
    acf: dict[str, float | None] = {}
    for lag in ACF_LAGS_S:
        k = int(round(lag / BIN_S))
        acf[f"{lag:g}"] = float(cov[k] / cov[0]) if pairs[k] >= MIN_PAIRS else None
    return {
        "steps": int(series.t_s.size),
        "bins": int(ok.sum()),
        "step_sd": float(np.std(series.log_speed)) if series.t_s.size else 0.0,
        "bin_sd": float(np.sqrt(cov[0])) if ok.any() else 0.0,
        "acf": acf,
    }


def describe_host_speed(report: Mapping[str, Any]) -> str:
    """One line for calibrate's notes: the fitted processes and the runs' autocorrelation."""
    comps = ", ".join(
        f"sd {s:.3f} tau {t:.2f} s" for s, t in zip(report["sigma"], report["tau_s"], strict=True)
    )
    runs = "; ".join(
        f"{str(path).rstrip('/').rsplit('/', 1)[-1]} "
        + " ".join(f"{lag}s {r:.2f}" for lag, r in rep["acf"].items() if r is not None)
        for path, rep in report["runs"].items()
    )
    return (
        f"host_speed: log speed = sum of OU processes ({comps}; the steps' own sd "
        f"{report['step_sd']:.3f} of {report['total_sd']:.3f}) from {report['bins']} bins of "
        f"{report['bin_s']} s; bins' autocorrelation by lag: {runs}"
    )


GPU_BOUND_SHARE = 0.5  # the CPU waited for the GPU this much of the runs' span: GPU-bound


def mean_over(runs: Sequence[Run]) -> tuple[str, float]:
    """`host_speed.mean_over` for these calibration runs (sim.cost.hostspeed): "time" when
    they were GPU-bound (their CPU waited on the GPU more than GPU_BOUND_SHARE of their span:
    steps came at the GPU's pace, uniform in the host's speed), else "steps"; and that share."""
    waited = span = 0.0
    for run in runs:
        s = run.arrays("steps")
        if len(s["sync_s"]) == 0:
            continue
        waited += float(np.nansum(s["sync_s"]))
        span += float(np.nanmax(s["gpu_end_s"]) - np.nanmin(s["schedule_start_s"]))
    share = waited / span if span > 0 else 0.0
    return ("time" if share > GPU_BOUND_SHARE else "steps"), share


def state_without_step(
    series: SpeedSeries, sigma: float, step_var: float, window_s: float = COPULA_WINDOW_S
) -> np.ndarray:
    """Each step's host state (log speed, its run's mean 0) from the other steps starting
    within `window_s` of it: their mean, shrunk by sigma^2 / (sigma^2 + step_var / their
    count); NaN where there are none."""
    t = series.t_s
    if not t.size:
        return np.zeros(0)
    order = np.argsort(t, kind="stable")
    ts = t[order]
    xs = (series.log_speed - series.log_speed.mean())[order]
    cum = np.concatenate([[0.0], np.cumsum(xs)])
    lo = np.searchsorted(ts, ts - window_s, "left")
    hi = np.searchsorted(ts, ts + window_s, "right")
    n = hi - lo - 1  # the step itself is inside its own window
    mean = (cum[hi] - cum[lo] - xs) / np.maximum(n, 1)
    s2 = sigma * sigma
    shrink = s2 / (s2 + step_var / np.maximum(n, 1))
    est = np.where(n > 0, shrink * mean, np.nan)
    out = np.empty_like(est)
    out[order] = est
    return out


def weighted_corr(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    mx, my = np.average(x, weights=w), np.average(y, weights=w)
    cov = np.average((x - mx) * (y - my), weights=w)
    vx, vy = np.average((x - mx) ** 2, weights=w), np.average((y - my) ** 2, weights=w)
    return float(cov / np.sqrt(vx * vy)) if vx > 0 and vy > 0 else 0.0


def fit_copula(
    prof: Mapping[str, Any], runs: Sequence[Run], steps: Steps, report: Mapping[str, Any],
    notes: list[str],
) -> tuple[dict[str, float], dict[str, Any]]:  # fmt: skip
    """`host_speed.rho` per CPU phase (module docstring) for a resolved profile and the
    host speed fit's `report` (fit_host_speed), and a report per phase: steps, the raw
    weighted correlation, the estimate's reliability, rho."""
    var = float(sum(s * s for s in report["sigma"]))
    step_var = float(report["step_sd"]) ** 2
    state = np.full(len(steps), np.nan)
    for s in step_log_speeds(prof, runs, steps):
        state[s.rows] = state_without_step(s, float(np.sqrt(var)), step_var)
    rho: dict[str, float] = {}
    out: dict[str, Any] = {"window_s": COPULA_WINDOW_S, "phases": {}}
    for phase, y, rows, pred in phase_predictions(prof, runs, steps):
        idx = np.flatnonzero(rows)
        ok = (pred > 0) & np.isfinite(state[idx])
        if ok.sum() < COPULA_MIN_STEPS:
            notes.append(f"host_speed.rho.{phase}: {int(ok.sum())} steps with a host state "
                         f"estimate (< {COPULA_MIN_STEPS}): rho 0")  # fmt: skip
            continue
        w, ratio, est = pred[ok], y[idx[ok]] / pred[ok], state[idx[ok]]
        order = np.argsort(ratio, kind="stable")
        cw = np.cumsum(w[order])
        u = np.empty_like(ratio)
        u[order] = (cw - w[order] / 2) / cw[-1]  # the weighted mid-rank, in (0, 1)
        score = np.asarray(normal_scores(u))
        raw = weighted_corr(score, est, w)
        mean = np.average(est, weights=w)
        rel = min(1.0, float(np.average((est - mean) ** 2, weights=w)) / var) if var > 0 else 0
        r = min(RHO_MAX, max(0.0, raw / np.sqrt(rel))) if rel > 0 else 0.0
        rho[phase] = round(r, 4)
        out["phases"][phase] = {"steps": int(ok.sum()), "corr": raw, "reliability": rel,
                                "rho": rho[phase]}  # fmt: skip
    return rho, out


def describe_copula(report: Mapping[str, Any]) -> str:
    """One line for calibrate's notes: the fitted rho per phase."""
    cells = ", ".join(
        f"{phase} {r['rho']:.3f} (corr {r['corr']:.3f}, reliability {r['reliability']:.2f}, "
        f"{r['steps']} steps)"
        for phase, r in report["phases"].items()
    )
    return (
        f"host_speed.rho (copula): per phase, the normal score's correlation with the host "
        f"state from the other steps within {report['window_s']} s, / sqrt(reliability): {cells}"
    )
