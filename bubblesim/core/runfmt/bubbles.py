"""Bubble accounting (docs/contracts.md): where the GPU idled while requests were waiting, and why.

Over the run's window W = [first arrival or GPU start, last finish or GPU end]:
- busy B: the union of GPU intervals (one per step, never overlapping: one stream);
- demand D: times when the engine holds an arrived, unfinished request (the union of
  [arrival_s, finish_s]; a request never finished counts until the end of W);
- bubble = (W \\ B) ∩ D; idle = (W \\ B) \\ D, which is not a bubble.
So busy + bubble + idle = span exactly, and bubble_fraction = bubble / (busy + bubble).

Gap k is the idle time before the k-th GPU interval in time order and belongs to that step;
the gap after the last GPU interval belongs to no step. Every piece of a bubble gets the cause
of what the CPU thread was doing: a GC pause, else a sync wait, else a CPU phase (in
CPU_PHASES order if two overlap), else `launch_gap` (the CPU in no recorded activity).
All numpy; gaps are processed in chunks so memory stays bounded on runs of millions of steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bubblesim.core.phases import CAUSE_LAUNCH_GAP, CPU_PHASES, GC, SYNC
from bubblesim.core.runfmt.intervals import (
    IntArray,
    SortedIntervals,
    covered,
    cut,
    measure_upto,
    merge_touching,
    union,
)
from bubblesim.core.runfmt.recording import Recording, RecordingError
from bubblesim.core.runfmt.spill import release
from bubblesim.core.runfmt.stats import FloatArray

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
    bubble_cause_code: np.ndarray  # (steps,) int8 into CAUSES, the cause with most s; -1 none
    piece_start: FloatArray  # bubble pieces before `pieces_until_s`, in time order,
    piece_end: FloatArray  # touching same-cause pieces merged (for the timeline)
    piece_cause: IntArray  # codes into CAUSES

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def bubble_fraction(self) -> float:
        denom = self.busy_s + self.bubble_s
        return self.bubble_s / denom if denom > 0 else 0.0

    @property
    def bubble_cause(self) -> np.ndarray:
        """(steps,) str: the main cause of the bubble before each step, "" without bubble."""
        names = np.array(("", *CAUSES), dtype=object)
        out: np.ndarray = names[self.bubble_cause_code.astype(np.int64) + 1]
        return out


def gpu_intervals(
    rec: Recording, tol_s: float, chunk: int = 1 << 20
) -> tuple[IntArray | slice, FloatArray, FloatArray]:
    """(steps, starts, ends) of GPU intervals in time order; overlaps <= tol_s are clipped.
    `steps` indexes the recording's steps: slice(None) when every step has one, in step order,
    none overlapping (a step loop's), and then starts and ends are the recording's own arrays
    (read-only: a run of millions of steps copies nothing; `chunk` steps are checked at a
    time)."""
    g0, g1 = rec.gpu_start, rec.gpu_end
    if g0.size and _plain(g0, g1, chunk):
        return slice(None), g0, g1
    has = ~np.isnan(g0)
    every = bool(has.all())  # copies, not gathers (~10x faster on a spill map)
    sid = np.arange(has.size) if every else np.flatnonzero(has)
    del has
    s = np.array(g0) if every else g0[sid]
    if not _ascending(s):  # a step loop's are in step order: no sort
        order = np.argsort(s, kind="stable")
        sid, s = sid[order], s[order]
        every = False
    e = np.array(g1) if every else g1[sid]
    release(g0, g1)
    if s.size > 1:  # in place on the copies s and e: a run of millions of steps
        prev_reach = np.maximum.accumulate(e)[:-1]
        over = np.subtract(prev_reach, s[1:])
        bad = np.flatnonzero(over > tol_s)
        del over
        if bad.size:
            j = int(bad[0]) + 1
            raise RecordingError(
                f"step {int(sid[j])}: GPU interval starts at {s[j]!r} before an earlier "
                f"step's GPU interval ends ({prev_reach[j - 1]!r}); one stream cannot overlap"
            )
        np.maximum(s[1:], prev_reach, out=s[1:])
        del prev_reach
        np.maximum(e, s, out=e)
    return sid, s, e


def _plain(starts: FloatArray, ends: FloatArray, chunk: int) -> bool:
    """Whether every step has a GPU interval (no NaN), each starting at or after every earlier
    one ends and ending at or after its start: `gpu_intervals` would change nothing."""
    reach = -math.inf  # the latest end before the chunk
    for c0 in range(0, starts.size, chunk):
        s, e = starts[c0 : c0 + chunk], ends[c0 : c0 + chunk]
        if not bool(np.all(e >= s)):  # NaN fails too
            return False
        if not (s[0] >= reach and bool(np.all(s[1:] >= np.maximum.accumulate(e)[:-1]))):
            return False
        reach = max(reach, float(e.max()))
    release(starts, ends)
    return True


def _activities(rec: Recording, gap_s: FloatArray, gap_e: FloatArray) -> dict[int, SortedIntervals]:
    """Per cause, the CPU activities that may overlap one of the gaps (disjoint, ascending):
    `SortedIntervals.near` of all of them, so a run with few bubbles keeps few (one
    activity's columns read at a time). Intervals that overlap no gap put no boundary inside
    one, so keeping more or fewer of those changes no piece."""
    cols = {j: (rec.phase_start[:, j], rec.phase_end[:, j]) for j in range(len(CPU_PHASES))}
    cols[CAUSES.index(SYNC)] = (rec.sync_start, rec.sync_end)
    cols[CAUSES.index(GC)] = (rec.gc_start, rec.gc_start + rec.gc_dur)
    acts = {}
    for label, (starts, ends) in cols.items():
        acts[label] = SortedIntervals.of(*_overlapping(starts, ends, gap_s, gap_e))
        release(rec.phase_start, rec.phase_end, rec.sync_start, rec.sync_end)
    return acts


def _overlapping(
    starts: FloatArray, ends: FloatArray, gap_s: FloatArray, gap_e: FloatArray, chunk: int = 1 << 20
) -> tuple[FloatArray, FloatArray]:
    """The intervals [starts, ends) that overlap one of the gaps (disjoint, ascending), in
    their order; `chunk` intervals at a time (NaN ones overlap nothing)."""
    nan = np.isnan(starts)
    if nan.all():
        return starts[:0], ends[:0]
    if not nan.any() and _ascending(starts) and _ascending(ends):
        return _overlapping_sorted(starts, ends, gap_s, gap_e)
    del nan
    keep = [np.zeros(0, np.int64)]
    for c0 in range(0, starts.size, chunk):
        x, y = starts[c0 : c0 + chunk], ends[c0 : c0 + chunk]
        k = np.searchsorted(gap_e, x, side="right")  # the first gap ending after x
        ok = np.flatnonzero(k < gap_e.size)
        keep.append(ok[gap_s[k[ok]] < y[ok]] + c0)
    idx = np.concatenate(keep)
    return starts[idx], ends[idx]


def _overlapping_sorted(
    starts: FloatArray, ends: FloatArray, gap_s: FloatArray, gap_e: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """`_overlapping` of intervals whose starts and ends both ascend (a step loop's phases,
    sync waits and pauses: one CPU thread): those overlapping gap k (start < gap_e[k] and
    end > gap_s[k]) are the run [lo_k, hi_k), found per gap, not per interval."""
    lo = np.searchsorted(ends, gap_s, side="right")
    hi = np.searchsorted(starts, gap_e, side="left")
    if lo.size > 1:  # both ascend with k: drop the part of a run its predecessor covered
        lo[1:] = np.maximum(lo[1:], hi[:-1])
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    size = hi - lo
    idx = np.arange(int(size.sum())) + np.repeat(lo - np.cumsum(size) + size, size)
    return starts[idx], ends[idx]


def _ascending(x: FloatArray) -> bool:
    return bool(np.all(x[1:] >= x[:-1]))


def account_bubbles(
    rec: Recording,
    overlap_tol_s: float = 1e-6,
    pieces_until_s: float = math.inf,
    chunk_gaps: int = 1 << 15,
) -> Bubbles:
    n = rec.num_steps
    sid, s, e = gpu_intervals(rec, overlap_tol_s)
    finite = [t[np.isfinite(t)] for t in (rec.arrival, rec.finish, rec.last_token)]
    finite += [s, e]  # finite already (validated)
    if not any(t.size for t in finite):
        return empty_bubbles(n)
    start_s = float(min(t.min() for t in finite if t.size))
    end_s = float(max(t.max() for t in finite if t.size))
    del finite
    ds, de = union(rec.arrival, np.where(np.isnan(rec.finish), end_s, rec.finish))

    # gap k ends where GPU interval k starts; the last gap ends at end_s. Both ends ascend.
    busy_s = float(np.sum(e - s))
    gap_s = np.concatenate(([start_s], e))
    del e
    gap_e = np.concatenate((s, [end_s]))
    del s
    np.maximum(gap_e, gap_s, out=gap_e)
    gap_bubble = np.empty(gap_s.size)
    upto_s = np.empty(min(gap_s.size, chunk_gaps * 32))
    for c0 in range(0, gap_s.size, chunk_gaps * 32):  # bounded temporaries, the same values
        c = slice(c0, c0 + chunk_gaps * 32)
        measure_upto(ds, de, gap_e[c], out=gap_bubble[c])
        before = measure_upto(ds, de, gap_s[c], out=upto_s[: gap_bubble[c].size])
        np.subtract(gap_bubble[c], before, out=gap_bubble[c])
    del upto_s
    bubble_s = float(np.sum(gap_bubble))
    gap_len = gap_e - gap_s
    idle_s = float(np.sum(gap_len)) - bubble_s
    idle_before = _per_step(n, sid, gap_len, np.nan)
    del gap_len
    bubble_before = _per_step(n, sid, gap_bubble, np.nan)

    by_cause = np.zeros(len(CAUSES))
    gap_cause = np.full(gap_s.size, -1, dtype=np.int8)
    kept: list[tuple[FloatArray, FloatArray, IntArray]] = []
    with_bubble = np.flatnonzero(gap_bubble > 0)
    acts = _activities(rec, gap_s[with_bubble], gap_e[with_bubble]) if with_bubble.size else {}
    demand = SortedIntervals.of(ds, de)
    for c0 in range(0, with_bubble.size, chunk_gaps):
        gaps = with_bubble[c0 : c0 + chunk_gaps]
        lo, hi, cause, gap = _pieces(gaps, gap_s, gap_e, demand, acts)
        length = hi - lo
        by_cause += np.bincount(cause, weights=length, minlength=len(CAUSES))
        g, main = _main_cause(gap, cause, length)
        gap_cause[g] = main
        if lo.size and lo[0] < pieces_until_s:
            kept.append(merge_touching(*(x[lo < pieces_until_s] for x in (lo, hi, cause))))
    cause_code = _per_step(n, sid, gap_cause, -1)
    p_start, p_end, p_cause = (
        merge_touching(*(np.concatenate(parts) for parts in zip(*kept)))
        if kept
        else (np.zeros(0), np.zeros(0), np.zeros(0, np.int64))
    )
    return Bubbles(
        start_s=start_s,
        end_s=end_s,
        busy_s=busy_s,
        bubble_s=bubble_s,
        idle_s=idle_s,
        by_cause={c: float(x) for c, x in zip(CAUSES, by_cause)},
        gpu_idle_before_s=idle_before,
        bubble_before_s=bubble_before,
        bubble_cause_code=cause_code,
        piece_start=p_start,
        piece_end=p_end,
        piece_cause=p_cause,
    )


def _per_step(n: int, sid: IntArray | slice, per_gap: np.ndarray, none: float) -> np.ndarray:
    """Gap k's value (the last gap's left out) for the step of GPU interval k; `none` for a
    step without one. Every step in order (`sid` a slice): a view, nothing copied."""
    if isinstance(sid, slice):
        return per_gap[:-1]
    out = np.full(n, none, dtype=per_gap.dtype)
    out[sid] = per_gap[:-1]
    return out


def _pieces(
    gaps: IntArray,
    gap_s: FloatArray,
    gap_e: FloatArray,
    demand: SortedIntervals,
    acts: dict[int, SortedIntervals],
) -> tuple[FloatArray, FloatArray, IntArray, IntArray]:
    """The bubble inside the given gaps (ascending ids), cut at every demand and activity
    boundary: (start, end, cause, gap id) per piece, in time order."""
    gs, ge = gap_s[gaps], gap_e[gaps]
    labels = list(acts)
    # only intervals that overlap a gap put a boundary inside one or cover a piece of one
    sets = [(gs, ge), demand.near(gs, ge)]
    sets += [acts[k].near(gs, ge) for k in labels]
    pts, idx = cut(sets)
    nseg = max(pts.size - 1, 0)
    bubble = np.flatnonzero(covered(*idx[0], nseg) & covered(*idx[1], nseg))
    cause = np.full(bubble.size, _LAUNCH_GAP, dtype=np.int64)
    open_ = np.ones(bubble.size, dtype=bool)
    for label in _PRIORITY:
        hit = open_ & covered(*idx[2 + labels.index(label)], nseg)[bubble]
        cause[hit] = label
        open_ &= ~hit
    # the gaps are disjoint and ascending: a segment's gap is the last one starting at or before
    started = np.cumsum(np.bincount(idx[0][0], minlength=nseg + 1)[:nseg]) - 1
    return pts[bubble], pts[bubble + 1], cause, gaps[started[bubble]]


def _main_cause(gap: IntArray, cause: IntArray, length: FloatArray) -> tuple[IntArray, IntArray]:
    """Per gap holding bubble: (gap, the cause with the most seconds; ties: the lower code)."""
    if gap.size == 0:
        return gap, cause
    key = gap * len(CAUSES) + cause  # pieces are in time order, so keys are nearly sorted
    order = np.argsort(key, kind="stable")
    key = key[order]
    first = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    total = np.add.reduceat(length[order], first)
    k_gap, k_cause = key[first] // len(CAUSES), key[first] % len(CAUSES)
    group = np.flatnonzero(np.concatenate(([True], k_gap[1:] != k_gap[:-1])))
    best = np.maximum.reduceat(total, group)
    is_best = total == np.repeat(best, np.diff(np.append(group, total.size)))
    winners = np.flatnonzero(is_best)  # in key order: the first per gap has the lowest code
    winners = winners[np.concatenate(([True], k_gap[winners][1:] != k_gap[winners][:-1]))]
    return k_gap[winners], k_cause[winners]


def empty_bubbles(n: int) -> Bubbles:
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
        bubble_cause_code=np.full(n, -1, dtype=np.int8),
        piece_start=none,
        piece_end=none,
        piece_cause=np.zeros(0, np.int64),
    )
