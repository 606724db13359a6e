"""Vectorized interval arithmetic on numpy arrays (seconds), used by bubble accounting.

Intervals are closed-open [start, end); sets of them are pairs of float64 arrays. Nothing here
loops in Python over intervals: sorting is a stable argsort (timsort, ~linear on the
concatenated, already sorted runs a step loop produces) and lookups are searchsorted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bubblesim.core.runfmt.stats import FloatArray

IntArray = np.ndarray


@dataclass(frozen=True)
class SortedIntervals:
    """Possibly overlapping intervals sorted by start, with `reach` = running max of ends."""

    starts: FloatArray
    ends: FloatArray
    reach: FloatArray

    @staticmethod
    def of(starts: FloatArray, ends: FloatArray) -> SortedIntervals:
        """Keeps the finite, non-empty ones."""
        keep = np.isfinite(starts) & np.isfinite(ends) & (ends > starts)
        s, e = starts[keep], ends[keep]
        if not _ascending(s):  # a step loop records them in order: usually no sort, no copy
            order = np.argsort(s, kind="stable")
            s, e = s[order], e[order]
        return SortedIntervals(s, e, e if _ascending(e) else np.maximum.accumulate(e))

    def window(self, lo_s: float, hi_s: float) -> tuple[FloatArray, FloatArray]:
        """A contiguous run that holds every interval overlapping [lo_s, hi_s] (and maybe a few
        that do not, which callers must tolerate)."""
        i0 = int(np.searchsorted(self.reach, lo_s, side="right"))
        i1 = int(np.searchsorted(self.starts, hi_s, side="left"))
        return self.starts[i0:i1], self.ends[i0:i1]

    def near(self, gap_s: FloatArray, gap_e: FloatArray) -> tuple[FloatArray, FloatArray]:
        """The intervals that may overlap some gap [gap_s[k], gap_e[k]) (gaps disjoint and
        ascending), in their order: a subset of `window` over all the gaps that holds every
        interval overlapping one of them, so that a run with a few short gaps reads only the
        intervals around those."""
        lo = np.searchsorted(self.reach, gap_s, side="right")  # before: ends <= gap start
        hi = np.searchsorted(self.starts, gap_e, side="left")  # from here: start >= gap end
        if lo.size > 1:  # both ascend; drop the part of a range its predecessor covered
            lo[1:] = np.maximum(lo[1:], hi[:-1])
        keep = hi > lo
        lo, hi = lo[keep], hi[keep]
        if lo.size == 1:
            return self.starts[lo[0] : hi[0]], self.ends[lo[0] : hi[0]]
        size = hi - lo
        idx = np.arange(int(size.sum())) + np.repeat(lo - np.cumsum(size) + size, size)
        return self.starts[idx], self.ends[idx]


def _ascending(x: FloatArray) -> bool:
    return bool(np.all(x[1:] >= x[:-1]))


def union(starts: FloatArray, ends: FloatArray) -> tuple[FloatArray, FloatArray]:
    """The union of intervals as sorted, disjoint, maximal intervals (touching ones merge)."""
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, reach = starts[order], np.maximum.accumulate(ends[order])
    first = np.flatnonzero(np.concatenate(([True], s[1:] > reach[:-1])))
    last = np.concatenate((first[1:] - 1, [s.size - 1]))
    return s[first], reach[last]


def measure_upto(
    starts: FloatArray,
    ends: FloatArray,
    x: FloatArray,
    chunk: int = 1 << 20,
    out: FloatArray | None = None,
) -> FloatArray:
    """|D ∩ (-inf, x]| for each x, with D = [starts, ends) sorted and disjoint (`chunk` x at a
    time: the temporaries of a run of millions of steps stay small), into `out` if given."""
    if out is None:
        out = np.empty(x.shape)
    if starts.size == 0:
        out[...] = 0.0
        return out
    width = ends - starts
    cum = np.concatenate(([0.0], np.cumsum(width)))
    for c0 in range(0, x.size, chunk):
        xc, part = x[c0 : c0 + chunk], out[c0 : c0 + chunk]
        i = _count_upto(starts, xc)
        i -= 1  # the last interval starting at or before x (-1: none)
        ic = np.maximum(i, 0)
        np.subtract(xc, starts[ic], out=part)
        np.clip(part, 0.0, width[ic], out=part)
        np.add(cum[ic], part, out=part)
        part[i < 0] = 0.0
    return out


def _count_upto(starts: FloatArray, x: FloatArray) -> IntArray:
    """np.searchsorted(starts, x, side="right"): how many starts are <= each x. For ascending x
    longer than `starts` (a run's gaps against its demand) by where each start falls in x
    instead: the same integers, a fraction of the lookups."""
    if x.size <= starts.size or not bool(np.all(x[1:] >= x[:-1])):
        out: IntArray = np.searchsorted(starts, x, side="right")
        return out
    # start s is <= x[k] exactly when the first x at or above s has index <= k
    first = np.searchsorted(x, starts, side="left")
    return np.cumsum(np.bincount(first, minlength=x.size + 1)[: x.size])


def cut(
    sets: list[tuple[FloatArray, FloatArray]],
) -> tuple[FloatArray, list[tuple[IntArray, IntArray]]]:
    """Cut the time line at every boundary of every interval set.

    Returns the distinct boundaries `pts` (elementary segment j is [pts[j], pts[j+1])) and, per
    set, the indices into `pts` of its starts and of its ends.
    """
    vals = np.concatenate([x for pair in sets for x in pair])
    order = np.argsort(vals, kind="stable")
    ordered = vals[order]
    new = np.ones(ordered.size, dtype=bool)
    new[1:] = ordered[1:] != ordered[:-1]
    idx = np.empty(vals.size, dtype=np.int64)
    idx[order] = np.cumsum(new) - 1
    out, at = [], 0
    for s, e in sets:
        out.append((idx[at : at + s.size], idx[at + s.size : at + s.size + e.size]))
        at += s.size + e.size
    return ordered[new], out


def covered(starts: IntArray, ends: IntArray, num_segments: int) -> np.ndarray:
    """Which elementary segments lie inside some interval [pts[starts[i]], pts[ends[i]])."""
    depth = np.bincount(starts, minlength=num_segments + 1)
    depth -= np.bincount(ends, minlength=num_segments + 1)
    out: np.ndarray = np.cumsum(depth[:num_segments]) > 0
    return out


def merge_touching(
    start: FloatArray, end: FloatArray, label: IntArray
) -> tuple[FloatArray, FloatArray, IntArray]:
    """Merge time-ordered pieces that touch and carry the same label."""
    if start.size == 0:
        return start, end, label
    new = np.concatenate(([True], (start[1:] != end[:-1]) | (label[1:] != label[:-1])))
    first = np.flatnonzero(new)
    last = np.concatenate((first[1:] - 1, [start.size - 1]))
    return start[first], end[last], label[first]
