"""`launch.eager_lag_ms`: how long after rank 0's launch an eager pass ends, at the earliest.

The simulator ends an eager pass at max(start + kernels, launch end + lag) (sim.stream.gpu_pass):
the GPU runs kernels as they are issued, so a pass cannot end before its last kernel is, and the
lag is what follows the last issue. On one GPU that is the last kernels' run time (H100,
llama3.2-1b: 0.16 ms). With tensor parallelism every rank issues the same eager step from its
own process, and each all-reduce waits for the slowest rank: the pass ends when the last rank's
launch does, which rank 0's hooks do not see (H100: llama3-8b TP2 a median 0.06 ms but a mean
3.1 ms, llama3-70b TP4 a median 38 ms: reports/tp/README.md).

Fitted as the mean of (GPU end - launch end) over the runs' eager steps whose kernels, by the
profile's fitted GPU pass, end before rank 0's launch does (there the lag shows alone; a
request's TPOT sums its steps, so the mean is what carries). Its spread between runs is large
at TP4 (a median of 9-38 ms over five llama3-70b runs of one host), which one number does not
hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bubblesim.core.phases import LAUNCH
from bubblesim.core.runfmt import Run

from .steps import Steps, predicted_gpu_ms

MIN_STEPS = 20  # fewer eager steps whose kernels end before the launch: no fit
MAX_STEPS = 2000  # steps evaluated per run (evenly spaced; the kernel model costs a call each)


def fit_eager_lag(
    runs: Sequence[Run], steps: Steps, prof: Mapping[str, Any]
) -> tuple[float | None, dict[str, Any]]:
    """(the lag in ms or None, a report) from the runs' steps and a resolved profile whose GPU
    pass is already fitted."""
    parts: list[tuple[np.ndarray, ...]] = []
    for i, run in enumerate(runs):
        mine = np.flatnonzero(steps.run == i)
        s = run.arrays("steps")
        rows = np.flatnonzero(~steps.graph[mine] & np.isfinite(steps.gpu_ms[mine]))
        if rows.size > MAX_STEPS:
            rows = rows[np.linspace(0, rows.size - 1, MAX_STEPS).astype(np.int64)]
        if rows.size == 0:
            continue
        cols = {k: v[mine] for k, v in steps.cols.items()}
        kernels_ms = predicted_gpu_ms(run, prof, cols, rows)
        le, gs, ge = s[f"{LAUNCH}_end_s"][rows], s["gpu_start_s"][rows], s["gpu_end_s"][rows]
        parts.append(((gs - le) * 1e3 + kernels_ms, (ge - le) * 1e3))
    report: dict[str, Any] = {"n": sum(len(p[0]) for p in parts), "launch_bound": 0}
    if not parts:
        return None, report
    # both relative to the launch's end (ms): the model's kernel end, the measured end
    kern_end = np.concatenate([p[0] for p in parts])
    meas_end = np.concatenate([p[1] for p in parts])
    ok = np.isfinite(kern_end) & np.isfinite(meas_end)
    kern_end, meas_end = kern_end[ok], meas_end[ok]
    seen = meas_end[kern_end < 0]  # the kernels end before the launch does: the lag shows
    report["launch_bound"] = int(seen.size)
    if seen.size < MIN_STEPS:
        return None, report
    lag = max(0.0, float(seen.mean()))
    p10, p50, p90 = (float(x) for x in np.percentile(seen, [10, 50, 90]))
    report.update(mean_ms=lag, p10_ms=p10, p50_ms=p50, p90_ms=p90)
    return lag, report


def describe(report: Mapping[str, Any]) -> str:
    if "mean_ms" not in report:
        return (f"launch.eager_lag_ms: {report['launch_bound']} of {report['n']} eager steps "
                f"end their kernels before the launch (< {MIN_STEPS}): not fitted")  # fmt: skip
    return (
        f"launch.eager_lag_ms: {report['mean_ms']:.3f} ms (mean GPU end after rank 0's launch "
        f"end over the {report['launch_bound']} of {report['n']} eager steps whose kernels end "
        f"before it; p10 {report['p10_ms']:.3f}, p50 {report['p50_ms']:.3f}, "
        f"p90 {report['p90_ms']:.3f} ms)"
    )
