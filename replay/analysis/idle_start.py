"""Fit `gpu_pass.idle_start`: how much faster a decode CUDA graph runs when it is issued to an
idle GPU than when it is queued behind the previous step.

What was measured (H100, 2026-11-26): on runs recorded with the hooks' one-anchor clock,
decode graphs that started after an idle gap looked up to ~50 % shorter than queued ones, the
more so the longer the gap; that was the GPU timer's drift against the host's clock (the step's
start clamped to its host launch, its end put early by the drift: reports/fidelity/README.md
section 0). On runs recorded with two anchors (engine.hooks) idle-start and queued graphs take
the same time, and `replay idlegap` measures no saving either. The fit stays for any GPU where
a real effect shows: a law in the gap, saved = min(per_ms x (idle - after_ms), max_fraction x
pass), chosen by least absolute error over the runs' idle-start decode (verify) graph steps
against the profile's pass, kept only when it fits better than no law; the older single ratio
is kept in the report for comparison.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bubblesim.core.runfmt import Run

from .steps import predicted_gpu_ms, run_config

MIN_STEPS = 30  # fewer idle-start graph steps than this: keep the base scale
MIN_IDLE_MS = 0.05  # a step counts as an idle start after this much GPU idle (the sim's rule)
MEASURED_IDLE_MS = 0.1  # ... and is used for the fit only after this much (clock alignment)


def _idle_steps(
    runs: Sequence[Run], profile: Mapping[str, Any], verify: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(idle ms, measured ms, predicted ms) of the runs' pure decode (verify: drafted) steps
    issued to a GPU idle for >= MEASURED_IDLE_MS."""
    idle_l: list[np.ndarray] = []
    meas_l: list[np.ndarray] = []
    pred_l: list[np.ndarray] = []
    for run in runs:
        cfg = run_config(run)
        if not cfg.cuda_graphs or (run.summary.get("source") or {}).get("kind") == "sim":
            continue
        s = run.arrays("steps")
        idle = s["gpu_idle_before_s"] * 1e3
        gpu_ms = (s["gpu_end_s"] - s["gpu_start_s"]) * 1e3
        drafted = s["draft_tokens"] > 0
        rows = np.flatnonzero(
            (s["num_prefill_reqs"] == 0)
            & (drafted if verify else ~drafted)
            & np.isfinite(gpu_ms)
            & (idle >= MEASURED_IDLE_MS)
        )
        if rows.size == 0:
            continue
        pred = predicted_gpu_ms(run, profile, s, rows)
        ok = pred > 0
        idle_l.append(idle[rows][ok])
        meas_l.append(gpu_ms[rows][ok])
        pred_l.append(pred[ok])
    if not idle_l:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    return np.concatenate(idle_l), np.concatenate(meas_l), np.concatenate(pred_l)


def fit_idle_start(
    runs: Sequence[Run], profile: Mapping[str, Any]
) -> tuple[dict[str, float] | None, dict[str, Any]]:
    """(the `gpu_pass.idle_start` table, or None when too few decode steps; a report). The
    verify law is fitted alongside when the runs hold enough idle-start verify steps."""
    idle_ms, meas, pred = _idle_steps(runs, profile, verify=False)
    report: dict[str, Any] = {"steps": int(idle_ms.size), "min_idle_ms": MEASURED_IDLE_MS}
    table: dict[str, float] = {"scale": 1.0, "min_idle_ms": MIN_IDLE_MS}
    if idle_ms.size < MIN_STEPS:
        report["note"] = f"{idle_ms.size} idle-start decode graph steps (< {MIN_STEPS}): not fitted"
    else:
        _fit_decode(idle_ms, meas, pred, table, report)
    _fit_verify(runs, profile, table, report)
    return (table if len(table) > 2 else None), report


NO_LAW = "no saving measured: the best law is no better than none"


def _beats_none(err_ms: float, meas: np.ndarray, pred: np.ndarray) -> bool:
    """A law's median |error| (ms) under no law's: only then is it kept."""
    return err_ms < float(np.median(np.abs(meas - pred)))


def _fit_decode(
    idle_ms: np.ndarray, meas: np.ndarray, pred: np.ndarray, table: dict[str, float],
    report: dict[str, Any],
) -> None:  # fmt: skip
    r = meas / pred
    per, after, frac, err = fit_shrink_law(idle_ms, meas, pred)
    if not _beats_none(err, meas, pred):
        report["note"] = NO_LAW
        return
    ratio = float(np.clip(np.median(r), 0.05, 1.0))
    report.update(
        scale=ratio,  # the older law's one ratio, for comparison
        ratio_p10=float(np.percentile(r, 10)),
        ratio_p90=float(np.percentile(r, 90)),
        idle_ms_p10=float(np.percentile(idle_ms, 10)),
        idle_ms_p90=float(np.percentile(idle_ms, 90)),
        shrink_per_ms=per,
        shrink_after_ms=after,
        shrink_max_fraction=frac,
        abs_err_ms_law=err,
        abs_err_ms_ratio=float(np.median(np.abs(meas - ratio * pred))),
        abs_err_ms_none=float(np.median(np.abs(meas - pred))),
    )
    table.update(shrink_per_ms=per, shrink_after_ms=after, shrink_max_fraction=frac)


def _fit_verify(
    runs: Sequence[Run], profile: Mapping[str, Any], table: dict[str, float],
    report: dict[str, Any],
) -> None:  # fmt: skip
    v_idle, v_meas, v_pred = _idle_steps(runs, profile, verify=True)
    report["verify_steps"] = int(v_idle.size)
    if v_idle.size >= MIN_STEPS:
        v_per, v_after, v_frac, v_err = fit_shrink_law(v_idle, v_meas, v_pred)
        if not _beats_none(v_err, v_meas, v_pred):
            report["verify_note"] = NO_LAW
            return
        table.update(
            verify_shrink_per_ms=v_per, verify_shrink_after_ms=v_after,
            verify_shrink_max_fraction=v_frac,
        )  # fmt: skip
        report.update(
            verify_shrink_per_ms=v_per, verify_shrink_after_ms=v_after,
            verify_shrink_max_fraction=v_frac, verify_abs_err_ms_law=v_err,
            verify_abs_err_ms_none=float(np.median(np.abs(v_meas - v_pred))),
            verify_ratio=float(np.median(v_meas / v_pred)),
        )  # fmt: skip


# the grid the law is chosen on (ms per ms of idle; ms; fraction of the pass)
PER_GRID = np.round(np.arange(0.02, 1.501, 0.02), 3)
AFTER_GRID = np.round(np.arange(0.0, 1.001, 0.025), 3)
FRACTION_GRID = np.round(np.arange(0.05, 0.901, 0.05), 3)
MAX_FIT_STEPS = 4000  # evenly spaced steps beyond this many (the law is smooth; speed)


def fit_shrink_law(
    idle_ms: np.ndarray, meas_ms: np.ndarray, pred_ms: np.ndarray
) -> tuple[float, float, float, float]:
    """(per_ms, after_ms, max_fraction, median |error| ms) of the law measured = pred -
    min(per_ms x (idle - after_ms)+, max_fraction x pred) with the least total absolute error
    on the grid. Deterministic: an exhaustive grid, ties to the first (smallest) values."""
    if idle_ms.size > MAX_FIT_STEPS:
        keep = np.linspace(0, idle_ms.size - 1, MAX_FIT_STEPS).round().astype(np.int64)
        idle_ms, meas_ms, pred_ms = idle_ms[keep], meas_ms[keep], pred_ms[keep]
    caps = FRACTION_GRID[:, None] * pred_ms[None, :]  # (fractions, steps)
    best = (np.inf, 0.0, 0.0, 0.0)
    for after in AFTER_GRID:
        over = np.maximum(idle_ms - after, 0.0)
        saved = PER_GRID[:, None] * over[None, :]  # (pers, steps)
        # (pers, fractions, steps): the law's error on every step
        err = np.abs(meas_ms - (pred_ms - np.minimum(saved[:, None, :], caps[None, :, :])))
        total = err.sum(axis=2)
        i, j = np.unravel_index(int(np.argmin(total)), total.shape)
        if total[i, j] < best[0] - 1e-9:
            best = (float(total[i, j]), float(PER_GRID[i]), float(after), float(FRACTION_GRID[j]))
    _, per, after, frac = best
    model = pred_ms - np.minimum(per * np.maximum(idle_ms - after, 0.0), frac * pred_ms)
    return per, after, frac, float(np.median(np.abs(meas_ms - model)))
