"""Fit of the CPU phases' measured spread (profile key `cpu_spread`, sim.cost.spread).

Per CPU phase, over the steps of the runs: ratio = measured phase time (less GC pauses and
sync waits, replay.analysis.steps) / the fitted profile's prediction for the step's shape (base
model + active terms + launch table: replay.analysis.quality.phase_predicted_ms). The table is the
ratio's quantiles at SPREAD_P, each step weighted by its predicted time (a step's share of the
phase's time: the few tiny predictions with a large ratio, e.g. the draft phase of a run without
drafting, do not spread the long steps), the p = 1 point at TOP_P (the slowest 0.01 % of steps,
warm-up and one-offs, left out), divided by the table's mean so the phase keeps the linear
model's mean (the weighted mean of the ratios is ~1 after a least-squares fit anyway; the fit
report gives it). Pure numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bubblesim.core.runfmt import Run
from replay.analysis.quality import phase_predictions
from replay.analysis.steps import Steps
from sim.cost.spread import mean_ratio

SPREAD_P = (0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)
TOP_P = 0.9999  # where the table's p = 1 point is read
MIN_STEPS = 200  # fewer steps of a phase: no spread for it (a note says so)


def weighted_quantiles(x: np.ndarray, w: np.ndarray, p: Sequence[float]) -> np.ndarray:
    """Quantiles of x weighted by w (> 0): linear between the weights' midpoints."""
    order = np.argsort(x, kind="stable")
    xs, ws = x[order], w[order]
    cw = np.cumsum(ws)
    mid = (cw - ws / 2) / cw[-1]
    return np.interp(np.asarray(p, np.float64), mid, xs)


def fit_spread(
    prof: Mapping[str, Any], runs: Sequence[Run], steps: Steps, notes: list[str],
    speed: np.ndarray | None = None,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, Any]]:  # fmt: skip
    """`cpu_spread` of a resolved profile on `runs` and its report (per phase: steps, the
    ratio's mean unweighted and weighted, the scale applied, the table). `speed`: each step's
    estimated host speed (replay.analysis.hostspeed), the predictions are multiplied by: the
    spread around the host's speed (`host_speed.cpu_spread`)."""
    spread: dict[str, dict[str, list[float]]] = {}
    report: dict[str, Any] = {}
    probs = [*SPREAD_P[:-1], TOP_P]
    for phase, y, rows, pred in phase_predictions(prof, runs, steps):
        if speed is not None:
            pred = pred * speed[rows]
        ok = pred > 0
        if ok.sum() < MIN_STEPS:
            notes.append(
                f"cpu_spread.{phase}: {int(ok.sum())} steps with a positive prediction "
                f"(< {MIN_STEPS}): no spread"
            )
            continue
        meas, pred = y[rows][ok], pred[ok]
        ratio = meas / pred
        q = weighted_quantiles(ratio, pred, probs)
        raw = {"p": list(SPREAD_P), "ratio": q.tolist()}
        scale = mean_ratio(raw)
        if not scale > 0:
            notes.append(f"cpu_spread.{phase}: the measured ratios have mean 0: no spread")
            continue
        table = {"p": list(SPREAD_P), "ratio": [round(float(r) / scale, 6) for r in q]}
        table["ratio"] = np.maximum.accumulate(table["ratio"]).tolist()  # rounding keeps order
        spread[phase] = table
        report[phase] = {
            "n": int(ratio.size),
            "ratio_mean": float(ratio.mean()),
            "ratio_weighted_mean": float(meas.sum() / pred.sum()),
            "table_scale": scale,
            "p50": float(np.interp(0.5, table["p"], table["ratio"])),
            "p99": float(np.interp(0.99, table["p"], table["ratio"])),
            "p999": float(np.interp(0.999, table["p"], table["ratio"])),
            **table,
        }
    return spread, report
