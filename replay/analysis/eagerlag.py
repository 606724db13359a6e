"""`launch.eager_lag_ms`: how long after rank 0's launch an eager pass ends, at the earliest.

The simulator ends an eager pass at max(start + kernels, launch end + lag) (sim.stream.gpu_pass):
the GPU runs kernels as they are issued, so a pass cannot end before its last kernel is, and the
lag is what follows the last issue. On one GPU that is the last kernels' run time (H100,
llama3.2-1b: a median 0.16 ms). With tensor parallelism every rank issues the same eager step
from its own process, and each all-reduce waits for the slowest rank: the pass ends when the
last rank's launch does, which rank 0's hooks do not see (H100: llama3-8b TP2 a median 0.09 ms
but a mean 3.5 ms, llama3-70b TP4 a median 38 ms: `python reports/tp/eager_lag.py`).

Fitted as the mean of (GPU end - launch end) over the runs' eager steps whose kernels, by the
profile's fitted GPU pass, end before rank 0's launch does (there the lag shows alone; a
request's TPOT sums its steps, so the mean is what carries). Its spread between runs is large
at TP4 (a median of 14-38 ms over four llama3-70b runs of one host), which one number does
not hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bubblesim.core.phases import LAUNCH
from bubblesim.core.runfmt import Run

from .steps import Steps, predicted_gpu_ms

MIN_STEPS = 20  # fewer eager steps whose kernels end before the launch: no fit
MAX_STEPS = 2000  # steps evaluated per run (evenly spaced; the kernel model costs a call each)


@dataclass
class EagerEnds:
    """The runs' eager steps, each relative to rank 0's launch end (ms): where the profile's
    kernels would end, where the GPU did end, and the launch's own length."""

    kernel_end_ms: np.ndarray
    gpu_end_ms: np.ndarray
    launch_ms: np.ndarray

    def launch_bound(self) -> np.ndarray:
        """The steps whose kernels end before the launch does: there the lag shows alone."""
        return self.kernel_end_ms < 0


def eager_ends(runs: Sequence[Run], steps: Steps, prof: Mapping[str, Any]) -> EagerEnds:
    """`EagerEnds` of the runs' eager steps (at most MAX_STEPS a run, evenly spaced) with a
    resolved profile whose GPU pass is fitted."""
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
        ls, le = s[f"{LAUNCH}_start_s"][rows], s[f"{LAUNCH}_end_s"][rows]
        gs, ge = s["gpu_start_s"][rows], s["gpu_end_s"][rows]
        parts.append(((gs - le) * 1e3 + kernels_ms, (ge - le) * 1e3, (le - ls) * 1e3))
    cat = [np.concatenate([p[k] for p in parts]) if parts else np.zeros(0) for k in range(3)]
    ok = np.isfinite(cat[0]) & np.isfinite(cat[1]) & np.isfinite(cat[2])
    return EagerEnds(*(c[ok] for c in cat))


def fit_eager_lag(
    runs: Sequence[Run], steps: Steps, prof: Mapping[str, Any]
) -> tuple[float | None, dict[str, Any]]:
    """(the lag in ms or None, a report) from the runs' steps and a resolved profile whose GPU
    pass is already fitted."""
    ends = eager_ends(runs, steps, prof)
    seen = ends.gpu_end_ms[ends.launch_bound()]
    report: dict[str, Any] = {"n": int(ends.gpu_end_ms.size), "launch_bound": int(seen.size)}
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
