"""Bubble accounting (DESIGN.md): where the GPU idled while requests were waiting, and why.

Over the run's window W = [first arrival or GPU start, last finish or GPU end]:
- busy B: the union of GPU intervals (one per step, never overlapping: one stream);
- demand D: times when the engine holds an arrived, unfinished request (the union of
  [arrival_s, finish_s]; a request never finished counts until the end of W);
- bubble = (W \\ B) ∩ D; idle = (W \\ B) \\ D, which is not a bubble.
So busy + bubble + idle = span exactly, and bubble_fraction = bubble / (busy + bubble).

Each idle gap belongs to the step whose GPU work ends it (the gap after the last GPU interval
belongs to no step). Every piece of a bubble gets the cause of what the CPU thread was doing:
a GC pause, else a sync wait, else a CPU phase (in CPU_PHASES order if two overlap), else
`launch_gap` (the CPU in no recorded activity). All of it is numpy over sorted intervals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.phases import CAUSE_LAUNCH_GAP, CPU_PHASES, GC, SYNC
from core.runfmt.recording import Recording, RecordingError
from core.runfmt.stats import FloatArray

CAUSES: tuple[str, ...] = (*CPU_PHASES, SYNC, GC, CAUSE_LAUNCH_GAP)
_LAUNCH_GAP = CAUSES.index(CAUSE_LAUNCH_GAP)
# labels tried in this order; the first whose activity covers a piece of bubble wins
_PRIORITY: tuple[int, ...] = (CAUSES.index(GC), CAUSES.index(SYNC), *range(len(CPU_PHASES)))


@dataclass(frozen=True)
class Bubbles:
    start_s: float  # the window W
    end_s: float
    busy_s: float
    bubble_s: float
    idle_s: float
    by_cause: dict[str, float]  # every cause of CAUSES, in that order
    gpu_idle_before_s: FloatArray  # (steps,), NaN where a step has no GPU interval
    bubble_before_s: FloatArray  # (steps,), NaN likewise
    bubble_cause: np.ndarray  # (steps,) str: the cause with most seconds, "" without bubble
    piece_start: FloatArray  # bubble pieces in time order, contiguous same-cause pieces merged
    piece_end: FloatArray
    piece_cause: np.ndarray  # int codes into CAUSES

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def bubble_fraction(self) -> float:
        denom = self.busy_s + self.bubble_s
        return self.bubble_s / denom if denom > 0 else 0.0


class _Intervals:
    """Possibly overlapping intervals, answering "is x covered?" for many x at once."""

    def __init__(self, starts: FloatArray, ends: FloatArray) -> None:
        keep = np.isfinite(starts) & np.isfinite(ends) & (ends > starts)
        order = np.argsort(starts[keep], kind="stable")
        self.starts = starts[keep][order]
        self.ends = ends[keep][order]
        self.reach = np.maximum.accumulate(self.ends) if self.ends.size else self.ends

    def covers(self, x: FloatArray) -> np.ndarray:
        i = np.searchsorted(self.starts, x, side="right") - 1
        if self.starts.size == 0:
            return np.zeros(x.shape, dtype=bool)
        return (i >= 0) & (self.reach[np.maximum(i, 0)] > x)


def _gpu_intervals(rec: Recording, tol_s: float) -> tuple[np.ndarray, FloatArray, FloatArray]:
    """(step ids, starts, ends) of GPU intervals in time order; overlaps <= tol_s are clipped."""
    sid = np.flatnonzero(~np.isnan(rec.gpu_start))
    sid = sid[np.argsort(rec.gpu_start[sid], kind="stable")]
    s, e = rec.gpu_start[sid], rec.gpu_end[sid]
    if s.size > 1:
        prev_reach = np.maximum.accumulate(e)[:-1]
        bad = np.flatnonzero(prev_reach - s[1:] > tol_s)
        if bad.size:
            j = int(bad[0]) + 1
            raise RecordingError(
                f"step {int(sid[j])}: GPU interval starts at {s[j]!r} before an earlier "
                f"step's GPU interval ends ({prev_reach[j - 1]!r}); one stream cannot overlap"
            )
        s = np.concatenate((s[:1], np.maximum(s[1:], prev_reach)))
        e = np.maximum(e, s)
    return sid, s, e


def _demand(arrival: FloatArray, finish: FloatArray, end_s: float) -> tuple[FloatArray, ...]:
    """Merged, sorted, disjoint [start, end] of the union of [arrival, finish]."""
    if arrival.size == 0:
        return np.zeros(0), np.zeros(0)
    f = np.where(np.isnan(finish), end_s, finish)
    order = np.argsort(arrival, kind="stable")
    a, reach = arrival[order], np.maximum.accumulate(f[order])
    new = np.concatenate(([True], a[1:] > reach[:-1]))
    first = np.flatnonzero(new)
    last = np.concatenate((first[1:] - 1, [a.size - 1]))
    return a[first], reach[last]


def _measure_upto(ds: FloatArray, de: FloatArray, x: FloatArray) -> FloatArray:
    """|D ∩ (-inf, x]| for disjoint sorted D = [ds, de]."""
    if ds.size == 0:
        return np.zeros(x.shape)
    cum = np.concatenate(([0.0], np.cumsum(de - ds)))
    i = np.searchsorted(ds, x, side="right") - 1
    ic = np.maximum(i, 0)
    part = np.clip(x - ds[ic], 0.0, de[ic] - ds[ic])
    out: FloatArray = np.where(i >= 0, cum[ic] + part, 0.0)
    return out


def _activities(rec: Recording) -> dict[int, _Intervals]:
    acts = {
        j: _Intervals(rec.phase_start[:, j], rec.phase_end[:, j]) for j in range(len(CPU_PHASES))
    }
    acts[CAUSES.index(SYNC)] = _Intervals(rec.sync_start, rec.sync_end)
    acts[CAUSES.index(GC)] = _Intervals(rec.gc_start, rec.gc_start + rec.gc_dur)
    return acts


def account_bubbles(rec: Recording, overlap_tol_s: float = 1e-6) -> Bubbles:
    n = rec.num_steps
    sid, s, e = _gpu_intervals(rec, overlap_tol_s)
    times = [rec.arrival, s, e, rec.finish, rec.last_token]
    finite = [t[np.isfinite(t)] for t in times]
    if not any(t.size for t in finite):
        return _empty(n)
    start_s = float(min(t.min() for t in finite if t.size))
    end_s = float(max(t.max() for t in finite if t.size))
    ds, de = _demand(rec.arrival, rec.finish, end_s)

    # gap k ends at GPU interval k (the step sid[k]); the last gap ends at end_s
    gap_s = np.concatenate(([start_s], e))
    gap_e = np.maximum(np.concatenate((s, [end_s])), gap_s)
    gap_bubble = _measure_upto(ds, de, gap_e) - _measure_upto(ds, de, gap_s)
    busy_s = float(np.sum(e - s))
    gaps_s = float(np.sum(gap_e - gap_s))
    bubble_s = float(np.sum(gap_bubble))

    idle_before = np.full(n, np.nan)
    bubble_before = np.full(n, np.nan)
    idle_before[sid] = (gap_e - gap_s)[:-1]
    bubble_before[sid] = gap_bubble[:-1]

    p_start, p_end, p_cause, p_gap = _pieces(rec, gap_s, gap_e, ds, de)
    lengths = p_end - p_start
    by_cause = np.bincount(p_cause, weights=lengths, minlength=len(CAUSES))
    cause = np.full(n, "", dtype=object)
    # pieces in the trailing gap (index sid.size) belong to no step
    sid_or_none = np.concatenate((sid, [-1]))
    step_of_piece = sid_or_none[p_gap]
    steps, main = _main_cause(step_of_piece, p_cause, lengths)
    cause[steps] = np.array(CAUSES, dtype=object)[main]
    m_start, m_end, m_cause = _merge(p_start, p_end, p_cause)
    return Bubbles(
        start_s=start_s,
        end_s=end_s,
        busy_s=busy_s,
        bubble_s=bubble_s,
        idle_s=gaps_s - bubble_s,
        by_cause={c: float(x) for c, x in zip(CAUSES, by_cause)},
        gpu_idle_before_s=idle_before,
        bubble_before_s=bubble_before,
        bubble_cause=cause,
        piece_start=m_start,
        piece_end=m_end,
        piece_cause=m_cause,
    )


def _pieces(
    rec: Recording, gap_s: FloatArray, gap_e: FloatArray, ds: FloatArray, de: FloatArray
) -> tuple[FloatArray, FloatArray, np.ndarray, np.ndarray]:
    """Bubble cut at every activity boundary: (start, end, cause code, gap index)."""
    gaps = _Intervals(gap_s, gap_e)
    demand = _Intervals(ds, de)
    # 1. the bubble intervals themselves: elementary segments of gap and demand boundaries
    pts = np.unique(np.concatenate((gaps.starts, gaps.ends, ds, de)))
    mid = (pts[:-1] + pts[1:]) / 2
    inside = gaps.covers(mid) & demand.covers(mid)
    bubble = _Intervals(pts[:-1][inside], pts[1:][inside])
    # 2. cut them at the activity boundaries that fall inside
    acts = _activities(rec)
    cuts = np.concatenate([np.concatenate((a.starts, a.ends)) for a in acts.values()])
    cuts = cuts[bubble.covers(cuts)]
    pts = np.unique(np.concatenate((bubble.starts, bubble.ends, cuts)))
    mid = (pts[:-1] + pts[1:]) / 2
    keep = bubble.covers(mid)
    lo, hi, mid = pts[:-1][keep], pts[1:][keep], mid[keep]
    cause = np.full(mid.shape, _LAUNCH_GAP, dtype=np.int64)
    open_ = np.ones(mid.shape, dtype=bool)
    for label in _PRIORITY:
        hit = open_ & acts[label].covers(mid)
        cause[hit] = label
        open_ &= ~hit
    gap = np.searchsorted(gap_s, mid, side="right") - 1
    return lo, hi, cause, gap


def _main_cause(step: np.ndarray, cause: np.ndarray, length: FloatArray) -> tuple[np.ndarray, ...]:
    """For each step with bubble pieces: the cause with the most seconds (ties: lower code)."""
    ok = step >= 0
    key = step[ok] * len(CAUSES) + cause[ok]
    uniq, inv = np.unique(key, return_inverse=True)
    total = np.bincount(inv, weights=length[ok])
    k_step, k_cause = uniq // len(CAUSES), uniq % len(CAUSES)
    order = np.lexsort((k_cause, -total, k_step))
    first = order[np.concatenate(([True], np.diff(k_step[order]) != 0))] if order.size else order
    return k_step[first], k_cause[first]


def _merge(start: FloatArray, end: FloatArray, cause: np.ndarray) -> tuple[np.ndarray, ...]:
    if start.size == 0:
        return start, end, cause
    new = np.concatenate(([True], (start[1:] != end[:-1]) | (cause[1:] != cause[:-1])))
    first = np.flatnonzero(new)
    last = np.concatenate((first[1:] - 1, [start.size - 1]))
    return start[first], end[last], cause[first]


def _empty(n: int) -> Bubbles:
    none = np.zeros(0)
    return Bubbles(
        start_s=0.0,
        end_s=0.0,
        busy_s=0.0,
        bubble_s=0.0,
        idle_s=0.0,
        by_cause=dict.fromkeys(CAUSES, 0.0),
        gpu_idle_before_s=np.full(n, np.nan),
        bubble_before_s=np.full(n, np.nan),
        bubble_cause=np.full(n, "", dtype=object),
        piece_start=none,
        piece_end=none,
        piece_cause=np.zeros(0, np.int64),
    )
