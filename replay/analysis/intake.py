"""Fit `intake`: the host time the engine loop spends taking new requests in, and how long after
an arrival an idle loop wakes.

`engine.Engine.run` checks the clock at the top of every loop iteration and calls `add_request`
for each request due by then (validation, the request's state, its synthetic prompt) before
the next step's schedule phase. That time lies in no CPU phase: in a measured run it is the gap
between the end of the last CPU phase before a schedule and that schedule's start. Measured on
H100 and H200 hosts (2026-11-27) it is ~0.01 ms with no request due and 0.14-0.29 ms + 0.03-0.10
ms per request with some (reports/fidelity/README.md section G). An engine with nothing to do
sleeps until the next arrival and wakes after it (the sleep's overshoot, 0.13-0.28 ms on the 1b
runs), taking in everything that arrived meanwhile. The simulator charges both
(`sim.loop.SimLoop.intake`, `SimLoop._idle`); this fits `ms` and `ms_per_request` by least
squares over the busy loop tops that took requests in, and `wake_ms` as the median of the tops
after a sleep, less their intake.

A busy top's requests are those that arrived between the previous top and the end of the CPU
work before its schedule; a top after a sleep (nothing was due when that work ended) starts at
the arrival it slept until and takes those that arrived before its schedule.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np

from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import Run, load_run

MIN_TOPS = 30  # fewer loop tops with requests than this: keep the base values
MIN_WAKES = 3  # fewer tops after a sleep than this: no wake fitted (0)
MAX_GAP_MS = 20.0  # a longer gap is not intake (a stall the record does not explain)


def intake_rows(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(requests taken in, gap ms, slept) for each loop top of a measured run that took some in.

    A busy top's gap runs from the CPU's last phase end to the schedule: the intake alone. A
    top after a sleep (nothing was due when the CPU work ended: the engine idled until the next
    arrival) has its gap from that arrival, so it holds the sleep's overshoot (the wake) too;
    its requests are those that arrived before the schedule."""
    s = run.arrays("steps")
    starts = np.concatenate([s[f"{p}_start_s"] for p in CPU_PHASES])
    ends = np.concatenate([s[f"{p}_end_s"] for p in CPU_PHASES])
    ok = np.isfinite(starts) & np.isfinite(ends)
    order = np.argsort(starts[ok], kind="stable")
    starts, ends = starts[ok][order], ends[ok][order]
    busy_until = np.maximum.accumulate(ends)  # the CPU's last phase end, by phase start
    sched = s["schedule_start_s"]
    before = np.searchsorted(starts, sched) - 1  # phases that started before this schedule
    prev_end = np.where(before >= 0, busy_until[np.maximum(before, 0)], -np.inf)
    arrivals = np.sort(run.arrays("requests")["arrival_s"])
    due_at_end = np.searchsorted(arrivals, prev_end, side="right")
    ns, gaps, slept = [], [], []
    # requests taken in by the tops before this one (the first step's top: the run's start)
    taken = int(np.searchsorted(arrivals, sched[0], side="right")) if len(sched) else 0
    for k in range(1, len(sched)):
        top, due, asleep = prev_end[k], int(due_at_end[k]), False
        if due <= taken:
            if taken >= arrivals.size or arrivals[taken] >= sched[k]:
                continue
            top, asleep = arrivals[taken], True
            due = int(np.searchsorted(arrivals, sched[k], side="left"))
        n, taken = due - taken, due
        gap_ms = (sched[k] - top) * 1e3
        if 0 <= gap_ms < MAX_GAP_MS:
            ns.append(n)
            gaps.append(gap_ms)
            slept.append(asleep)
    return np.asarray(ns, np.float64), np.asarray(gaps, np.float64), np.asarray(slept, bool)


def fit_intake(runs: Sequence[Run]) -> tuple[dict[str, float] | None, dict[str, Any]]:
    """(the `intake` table, or None when too few busy loop tops took requests in; a report).
    `ms` and `ms_per_request`: least squares over the busy tops; `wake_ms`: the median of the
    slept tops' gaps less their intake (0 with fewer than MIN_WAKES of them)."""
    parts = [intake_rows(r) for r in runs if (r.summary.get("source") or {}).get("kind") != "sim"]
    n = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0)
    g = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0)
    slept = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, bool)
    busy = ~slept
    report: dict[str, Any] = {"tops": int(busy.sum()), "wakes": int(slept.sum())}
    if busy.sum() < MIN_TOPS:
        report["note"] = f"{busy.sum()} loop tops took requests in (< {MIN_TOPS}): not fitted"
        return None, report
    nb, gb = n[busy], g[busy]
    if np.unique(nb).size > 1:
        x = np.stack([np.ones_like(nb), nb], axis=1)
        (ms, per), *_ = np.linalg.lstsq(x, gb, rcond=None)
    else:  # one count only: no slope to see, all of it per intake
        ms, per = float(np.mean(gb)), 0.0
    ms, per = max(float(ms), 0.0), max(float(per), 0.0)
    wake = 0.0
    if slept.sum() >= MIN_WAKES:
        wake = max(float(np.median(g[slept] - ms - per * n[slept])), 0.0)
    one = gb[nb == 1]
    report.update(
        ms=ms,
        ms_per_request=per,
        wake_ms=wake,
        one_p50_ms=float(np.median(one)) if one.size else float("nan"),
        mean_requests=float(nb.mean()),
    )
    return {"ms": ms, "ms_per_request": per, "wake_ms": wake}, report


def describe(table: dict[str, float], report: dict[str, Any]) -> str:
    """The profile note for a fitted `intake`."""
    return (
        f"intake: taking requests in costs the host {table['ms']:.3f} ms + "
        f"{table['ms_per_request']:.3f} ms per request (least squares over {report['tops']} "
        f"loop tops, {report['mean_requests']:.2f} requests each; one request: median "
        f"{report['one_p50_ms']:.3f} ms); an idle loop wakes {table['wake_ms']:.3f} ms after "
        f"the next arrival (median of {report['wakes']} wakes)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Each measured run folder's own fit, then all of them pooled (as `replay calibrate`):
    `python -m replay.analysis.intake RUN [RUN ...]`."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args(argv)
    runs = [load_run(r) for r in args.runs]
    print("| run | busy loop tops taking requests in | requests each | ms | ms per request | "
          "one request: median ms | wakes from idle | wake ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for label, group in [*((r.path.name, [r]) for r in runs), ("(pooled)", runs)]:
        table, rep = fit_intake(group)
        if table is None:
            print(f"| {label} | {rep['tops']} | - | - | - | - | {rep['wakes']} | - |")
            continue
        print(
            f"| {label} | {rep['tops']} | {rep['mean_requests']:.2f} | {table['ms']:.3f} "
            f"| {table['ms_per_request']:.3f} | {rep['one_p50_ms']:.3f} | {rep['wakes']} "
            f"| {table['wake_ms']:.3f} |"
        )


if __name__ == "__main__":
    main()
