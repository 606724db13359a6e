"""Level a sweep-fitted decode model to the calibration runs' clean decode steps.

A sweep that times whole steps (`measures: "step"`) needs no offset by construction, yet on the
H100 (2026-11-26, llama3.2-1b) the calibration run's clean decode steps sat a median +4.2 % above
the sweep-fitted table at the same shapes, and the out-of-sample checks +2 to +7 % (batches of
8-48; the cause is open: reports/fidelity/README.md). Scaling the decode model by the runs'
median measured/predicted ratio took the long-output check's TPOT p50 error from -24 % to
-0.2 %. The sweep keeps the shape of the surface (how time grows with rows and KV); the one
short run sets its level, which is what "calibration = sweep + one short run" asks of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bubblesim.core.runfmt import Run

from .steps import CLEAN_TOL_S, predicted_gpu_ms, run_config

MIN_STEPS = 200  # fewer clean decode graph steps than this: no levelling
MAX_SAMPLES = 4000  # steps evaluated per run (evenly spaced): the median needs no more
TOLERANCE = 0.01  # a level within 1 % is left alone


def level_ratio(runs: Sequence[Run], decode: Mapping[str, Any]) -> tuple[float | None, dict]:
    """Median measured/predicted over the runs' clean, queued decode graph steps (the GPU began
    after the host had issued the whole step and had not idled before it: the steps the sweep's
    samples stand for), or None when there are too few."""
    ratios: list[np.ndarray] = []
    for run in runs:
        cfg = run_config(run)
        if (run.summary.get("source") or {}).get("kind") == "sim" or not cfg.cuda_graphs:
            continue
        s = run.arrays("steps")
        ends = np.fmax(s["sample_end_s"], s["launch_end_s"])
        rows = np.flatnonzero(
            (s["num_prefill_reqs"] == 0)
            & (s["draft_tokens"] == 0)
            & (s["history_tokens"] == 0)  # penalties: gpu_pass.history, not the level
            & np.isfinite(s["gpu_start_s"])
            & (s["gpu_start_s"] >= ends - CLEAN_TOL_S)  # clean: kernels alone
            & (s["gpu_idle_before_s"] < CLEAN_TOL_S)  # queued, as the sweep's samples are
        )
        if rows.size == 0:
            continue
        rows = rows[:: max(1, rows.size // MAX_SAMPLES)]
        meas = (s["gpu_end_s"][rows] - s["gpu_start_s"][rows]) * 1e3
        pred = predicted_gpu_ms(run, {"version": 1, "gpu_pass": {"decode": decode}}, s, rows)
        ok = pred > 0
        ratios.append(meas[ok] / pred[ok])
    r = np.concatenate(ratios) if ratios else np.zeros(0)
    report: dict[str, Any] = {"steps": int(r.size)}
    if r.size < MIN_STEPS:
        return None, report
    report.update(
        ratio=float(np.median(r)),
        ratio_p10=float(np.percentile(r, 10)),
        ratio_p90=float(np.percentile(r, 90)),
    )
    return float(np.median(r)), report


def scaled(model: Any, k: float) -> Any:
    """A GPU pass model (linear, table, spline, or a max of them) with every time times k."""
    if isinstance(model, list):
        return [scaled(m, k) for m in model]
    if not isinstance(model, dict):
        return model
    out: dict[str, Any] = {}
    for key, v in model.items():
        if key == "max":
            out[key] = scaled(v, k)
        elif key in ("table", "spline"):
            out[key] = {**v, "ms": _times(v["ms"], k)}
        else:  # a linear term's coefficient (ms per unit)
            out[key] = float(v) * k
    return out


def _times(ms: Any, k: float) -> Any:
    return [_times(x, k) for x in ms] if isinstance(ms, list) else float(ms) * k
