"""`launch.eager_lag_ms`: how long after the last rank's launch an eager pass ends, at the
earliest; and `tp_ranks`: where the last worker rank's launch ends.

The simulator ends an eager pass at max(start + kernels, launch end + lag) (sim.stream.gpu_pass):
the GPU runs kernels as they are issued, so a pass cannot end before its last kernel is, and the
lag is what follows the last issue. On one GPU that is the last kernels' run time (H100,
llama3.2-1b: a median 0.16 ms). With tensor parallelism every rank issues the same eager step
from its own process, and each all-reduce waits for the slowest rank: the pass ends when the
last rank's launch does. Runs that carry the worker ranks' own launches (ranks.parquet,
replay.analysis.ranks) show it directly: on 2 and 4 x H100 the GPU ends a median 0.006-0.11 ms
after the later of rank 0's and the last worker's launch end (`python reports/tp/eager_lag.py`).

`fit_eager_lag`: the mean of (GPU end - the last launch end) over the runs' eager steps whose
kernels, by the profile's fitted GPU pass, end before the last launch does (there the lag shows
alone; a request's TPOT sums its steps, so the mean is what carries); where some runs recorded
the worker ranks, over their steps only (rank 0's launch end alone hides a lag of 14-38 ms
median at TP4). `fit_rank_launches`: the `tp_ranks` relation (its docstring).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bubblesim.core.phases import LAUNCH
from bubblesim.core.runfmt import Run

from .ranks import read_ranks
from .spread import SPREAD_P, TOP_P
from .steps import Steps, predicted_gpu_ms

MIN_STEPS = 20  # fewer eager steps whose kernels end before the launch: no fit
MAX_STEPS = 2000  # steps evaluated per run (evenly spaced; the kernel model costs a call each)


@dataclass
class EagerEnds:
    """The runs' eager steps, each relative to rank 0's launch end (ms): where the profile's
    kernels would end, where the GPU did end, the launch's own length, and where the last
    worker rank's launch ended (tensor parallelism, replay.analysis.ranks; NaN where the run
    has no record)."""

    kernel_end_ms: np.ndarray
    gpu_end_ms: np.ndarray
    launch_ms: np.ndarray
    ranks_end_ms: np.ndarray

    def issue_end_ms(self) -> np.ndarray:
        """When the last rank's launch ended: rank 0's (0) or, where the run recorded the
        worker ranks' and one ended later, that one."""
        return np.fmax(self.ranks_end_ms, 0.0)

    def launch_bound(self) -> np.ndarray:
        """The steps whose kernels end before the last launch does: there the lag shows
        alone."""
        return self.kernel_end_ms < self.issue_end_ms()


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
        ranks = read_ranks(run.path)
        if ranks is None:
            last = np.full(len(rows), np.nan)
        else:
            last = ranks.last_end_s(len(s["gpu_end_s"]))[rows]
        parts.append(
            ((gs - le) * 1e3 + kernels_ms, (ge - le) * 1e3, (le - ls) * 1e3, (last - le) * 1e3)
        )
    cat = [np.concatenate([p[k] for p in parts]) if parts else np.zeros(0) for k in range(4)]
    ok = np.isfinite(cat[0]) & np.isfinite(cat[1]) & np.isfinite(cat[2])
    return EagerEnds(*(c[ok] for c in cat))


def fit_eager_lag(ends: EagerEnds) -> tuple[float | None, dict[str, Any]]:
    """(the lag in ms or None, a report) from the runs' eager steps (`eager_ends`, with a
    profile whose GPU pass is already fitted)."""
    bound = ends.launch_bound()
    recorded = np.isfinite(ends.ranks_end_ms)
    if recorded.any():  # where the worker ranks were recorded, their steps alone say it
        bound &= recorded
    seen = ends.gpu_end_ms[bound] - ends.issue_end_ms()[bound]
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
        f"launch.eager_lag_ms: {report['mean_ms']:.3f} ms (mean GPU end after the last rank's "
        f"launch end over the {report['launch_bound']} of {report['n']} eager steps whose "
        f"kernels end before it; p10 {report['p10_ms']:.3f}, p50 {report['p50_ms']:.3f}, "
        f"p90 {report['p90_ms']:.3f} ms)"
    )


def fit_rank_launches(ends: EagerEnds) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`tp_ranks` (sim.cost.spread) from the runs' eager steps (`eager_ends`) with the worker
    ranks' launches recorded (ranks.parquet), or None where fewer than MIN_STEPS; and a
    report.

    R: where the last worker rank's launch ends, from rank 0's launch start, in units of rank
    0's launch (1: together). It falls as rank 0's own launch grows (rank 0 is then often the
    last), so it is fitted against rank 0's multiplier m (its launch over the runs' mean eager
    launch): log R = intercept + slope x log m + e, and e's spread kept as a quantile table of
    exp(e) (`residual`). On the llama3-70b TP4 calibration run (4 x H100) the mean lag is
    21.1 ms; independent draws of the other ranks gave 31.5 ms, this fit gives 23.8 ms
    (`python reports/tp/eager_lag.py`'s model line)."""
    ok = np.isfinite(ends.ranks_end_ms) & (ends.launch_ms > 0)
    report: dict[str, Any] = {"n": int(ok.sum())}
    if ok.sum() < MIN_STEPS:
        return None, report
    launch = ends.launch_ms[ok]
    ratio = np.maximum(1e-3, 1.0 + ends.ranks_end_ms[ok] / launch)
    mult = launch / launch.mean()
    slope, intercept = (float(x) for x in np.polyfit(np.log(mult), np.log(ratio), 1))
    resid = np.exp(np.log(ratio) - (intercept + slope * np.log(mult)))
    q = np.quantile(resid, [*SPREAD_P[:-1], TOP_P])
    table = {"p": list(SPREAD_P), "ratio": np.maximum.accumulate(np.round(q, 6)).tolist()}
    lag_ms = np.fmax(ends.ranks_end_ms[ok], 0.0)
    report.update(
        intercept=intercept,
        slope=slope,
        p50=float(np.median(ratio)),
        rank0_last=float(np.mean(ratio <= 1.0)),
        mean_lag_ms=float(lag_ms.mean()),
        corr=float(np.corrcoef(np.log(mult), np.log(ratio))[0, 1]),
    )
    fit = {"intercept": round(intercept, 6), "slope": round(slope, 6), "residual": table,
           "steps": int(ok.sum())}  # fmt: skip
    return fit, report


def describe_ranks(report: Mapping[str, Any]) -> str:
    if "slope" not in report:
        return (f"tp_ranks: {report['n']} eager steps with the worker ranks' launches recorded "
                f"(< {MIN_STEPS}, or runs without ranks.parquet): not fitted")  # fmt: skip
    return (
        f"tp_ranks: the last worker rank's launch ends at {report['p50']:.3f}x rank 0's launch "
        f"from its start (p50 over {report['n']} eager steps; rank 0 last on "
        f"{100 * report['rank0_last']:.0f} %, the lag past its end a mean "
        f"{report['mean_lag_ms']:.2f} ms); log R = {report['intercept']:.3f} "
        f"{report['slope']:+.3f} x log(rank 0's multiplier) (correlation {report['corr']:+.2f})"
    )
