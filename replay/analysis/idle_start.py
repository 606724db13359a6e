"""Fit `gpu_pass.idle_start`: how much faster a decode CUDA graph runs when it is issued to an
idle GPU than when it is queued behind the previous step.

Measured on an H100 (llama3.2-1b, 2026-11-26): in one depth-2 run, decode graphs that started
after >= 100 us of GPU idle took 0.97-1.42 ms against 1.37-1.82 ms for queued ones of the same
batch sizes and contexts; at depth 1 (every step starts idle) the same held against depth 3 on
one workload. The mechanism is not known (it is not waits inside the interval: the hooks'
marks show the forward's own span is shorter). The decode pass that `calibrate` fits comes from
kernel-only ("clean") steps, which at depth 2 are the queued ones, so the sim applies a scale
to graphs it issues to an idle GPU (sim.stream.gpu_pass), fitted here as the median ratio of
measured to predicted time over the runs' idle-start decode graph steps.
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


def fit_idle_start(
    runs: Sequence[Run], profile: Mapping[str, Any]
) -> tuple[dict[str, float] | None, dict[str, Any]]:
    """(the `gpu_pass.idle_start` table, or None when too few steps; a report)."""
    ratios: list[np.ndarray] = []
    for run in runs:
        cfg = run_config(run)
        if not cfg.cuda_graphs or (run.summary.get("source") or {}).get("kind") == "sim":
            continue
        s = run.arrays("steps")
        idle = s["gpu_idle_before_s"] * 1e3
        gpu_ms = (s["gpu_end_s"] - s["gpu_start_s"]) * 1e3
        rows = np.flatnonzero(
            (s["num_prefill_reqs"] == 0)
            & (s["draft_tokens"] == 0)
            & np.isfinite(gpu_ms)
            & (idle >= MEASURED_IDLE_MS)
        )
        if rows.size == 0:
            continue
        pred = predicted_gpu_ms(run, profile, s, rows)
        ok = pred > 0
        ratios.append(gpu_ms[rows][ok] / pred[ok])
    r = np.concatenate(ratios) if ratios else np.zeros(0)
    report: dict[str, Any] = {"steps": int(r.size), "min_idle_ms": MEASURED_IDLE_MS}
    if r.size < MIN_STEPS:
        report["note"] = f"{r.size} idle-start decode graph steps (< {MIN_STEPS}): not fitted"
        return None, report
    scale = float(np.clip(np.median(r), 0.05, 1.0))
    report.update(
        scale=scale,
        ratio_p10=float(np.percentile(r, 10)),
        ratio_p90=float(np.percentile(r, 90)),
    )
    return {"scale": scale, "min_idle_ms": MIN_IDLE_MS}, report
