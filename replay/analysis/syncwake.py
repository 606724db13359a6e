"""Fit `sync_wait.wake_ms`: how long after a GPU event a host that waits for it resumes.

The engine's one deliberate host wait (`OutputRing.wait`) blocks until the step's tokens are
on the host: an event on the compute stream, a D2H copy on the copy stream, an event the host
synchronizes on. Measured on an H100 host (2026-11-26, llama3.2-1b, depths 1-3), the host left
that wait 0.47-0.53 ms (median) after the step's GPU end event, whatever the depth; at depth 1
this sits on every step's critical path (a step period of ~1.96 ms held 0.51 ms of it). The
simulator ends every host wait `wake_ms` after its event (sim.loop._sync); this fits it as
the median of (wait end - GPU end) over the steps whose host waited for their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bubblesim.core.runfmt import Run

MIN_WAITS = 30  # fewer waits than this: keep the base value


def fit_sync_wake(runs: Sequence[Run]) -> tuple[dict[str, float] | None, dict[str, Any]]:
    """(the `sync_wait` table, or None when too few waits; a report)."""
    lat: list[np.ndarray] = []
    for run in runs:
        if (run.summary.get("source") or {}).get("kind") == "sim":
            continue
        s = run.arrays("steps")
        s0, s1, g1 = s["sync_start_s"], s["sync_end_s"], s["gpu_end_s"]
        waited = np.isfinite(s0) & np.isfinite(g1) & (s0 < g1) & (s1 >= g1)
        lat.append((s1 - g1)[waited] * 1e3)
    x = np.concatenate(lat) if lat else np.zeros(0)
    report: dict[str, Any] = {"waits": int(x.size)}
    if x.size < MIN_WAITS:
        report["note"] = f"{x.size} host waits for a step's tokens (< {MIN_WAITS}): not fitted"
        return None, report
    wake = float(np.median(x))
    report.update(
        wake_ms=wake, p10_ms=float(np.percentile(x, 10)), p90_ms=float(np.percentile(x, 90))
    )
    return {"wake_ms": wake}, report


def describe(wake: dict[str, float], report: dict[str, Any]) -> str:
    """The profile note for a fitted `sync_wait`."""
    return (
        f"sync_wait: a waiting host resumes {wake['wake_ms']:.3f} ms after the event "
        f"(median of {report['waits']} waits; p10 {report['p10_ms']:.3f}, "
        f"p90 {report['p90_ms']:.3f} ms)"
    )
