"""Bubble accounting's shortcuts give what the general code gives: `_overlapping` of ascending
intervals (a step loop's) searched per gap, `measure_upto` computed in place, `gpu_intervals`
of a step loop's GPU intervals without copies, and the longest sync wait of steps that
waited once each."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblesim.core.runfmt.bubbles import _overlapping, gpu_intervals
from bubblesim.core.runfmt.intervals import measure_upto, union
from bubblesim.core.runfmt.recording import RecordingError
from bubblesim.core.runfmt.tables import _longest_per_step


def _brute(starts, ends, gs, ge):  # type: ignore[no-untyped-def]
    hit = (starts[:, None] < ge[None, :]) & (ends[:, None] > gs[None, :])
    keep = np.flatnonzero(hit.any(axis=1))
    return starts[keep], ends[keep]


def _gaps(rng: np.random.Generator, k: int, span: float) -> tuple[np.ndarray, np.ndarray]:
    edges = np.sort(rng.uniform(0, span, 2 * k))
    return edges[0::2], edges[1::2]  # disjoint, ascending


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 60), st.integers(0, 12), st.booleans())
def test_overlapping_ascending_is_the_general_answer(seed: int, n: int, k: int, nan: bool) -> None:
    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1.0, n))  # one thread: starts and ends both ascend
    ends = starts + rng.exponential(0.6, n) * (rng.random(n) < 0.9)  # some empty
    ends = np.maximum.accumulate(ends)
    if nan and n:  # a phase some steps skip: the general path
        starts[rng.random(n) < 0.3] = np.nan
        ends[np.isnan(starts)] = np.nan
    gs, ge = _gaps(rng, k, float(starts[-1]) + 2 if n and not np.isnan(starts[-1]) else 10.0)
    got = _overlapping(starts, ends, gs, ge)
    fin = ~np.isnan(starts)
    want = _brute(starts[fin], ends[fin], gs, ge)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
    # the general path (taken with NaN rows), one interval a chunk
    general = _overlapping(starts, ends, gs, ge, chunk=1) if nan else got
    for g, w in zip(general, want):
        assert np.array_equal(g, w)


def _measure_reference(starts, ends, x):  # type: ignore[no-untyped-def]
    """The formula measure_upto implements, in its original allocating form."""
    cum = np.concatenate(([0.0], np.cumsum(ends - starts)))
    i = np.searchsorted(starts, x, side="right") - 1
    ic = np.maximum(i, 0)
    part = np.clip(x - starts[ic], 0.0, ends[ic] - starts[ic])
    return np.where(i >= 0, cum[ic] + part, 0.0)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.integers(0, 300))
def test_measure_upto_bit_for_bit(seed: int, m: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.uniform(0, 100, m)
    ds, de = union(a, a + rng.exponential(3.0, m))
    x = np.sort(rng.uniform(-5, 110, n))  # ascending and longer than ds: the counting path
    for xs in (x, x[::-1].copy()):
        got = measure_upto(ds, de, xs, chunk=64)
        assert np.array_equal(got.view(np.int64), _measure_reference(ds, de, xs).view(np.int64))


def _reference_gpu_intervals(g0, g1, tol):  # type: ignore[no-untyped-def]
    """gpu_intervals as it was before its shortcut: copies, clipped in place."""
    sid = np.flatnonzero(~np.isnan(g0))
    s, e = g0[sid], g1[sid]
    order = np.argsort(s, kind="stable")
    sid, s, e = sid[order], s[order], e[order]
    if s.size > 1:
        prev_reach = np.maximum.accumulate(e)[:-1]
        np.maximum(s[1:], prev_reach, out=s[1:])
        np.maximum(e, s, out=e)
    return sid, s, e


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(1, 40),
    st.sampled_from(["plain", "touching", "overlap", "nan", "unordered"]),
    st.integers(1, 9),
)
def test_gpu_intervals_shortcut_is_the_general_answer(
    seed: int, n: int, kind: str, chunk: int
) -> None:
    rng = np.random.default_rng(seed)
    gap = rng.exponential(1.0, n) * (rng.random(n) < 0.8)
    dur = rng.exponential(1.0, n)
    start = np.cumsum(gap + np.concatenate(([0.0], dur[:-1])))
    end = start + dur
    if kind == "touching":
        start[1:] = end[:-1]
        end = start + dur
    if kind == "overlap" and n > 1:  # one start a hair before the previous end (within tol)
        k = int(rng.integers(1, n))
        start[k] = end[k - 1] - 5e-7
        end[k] = max(end[k], start[k])
    if kind == "nan":
        start[rng.random(n) < 0.3] = np.nan
        end[np.isnan(start)] = np.nan
    if kind == "unordered" and n > 1:
        p = rng.permutation(n)
        start, end = start[p], end[p]
    rec = SimpleNamespace(gpu_start=start, gpu_end=end)
    sid, s, e = gpu_intervals(rec, 1e-6, chunk=chunk)  # type: ignore[arg-type]
    want_sid, want_s, want_e = _reference_gpu_intervals(start, end, 1e-6)
    assert np.array_equal(np.arange(n)[sid], want_sid)
    assert np.array_equal(s, want_s) and np.array_equal(e, want_e)
    if isinstance(sid, slice):
        assert s is start and e is end  # nothing copied
    else:
        assert kind != "plain" or n == 0


def test_gpu_intervals_refuses_overlap_beyond_tolerance() -> None:
    start = np.array([0.0, 1.0, 1.5])
    end = np.array([1.0, 2.0, 3.0])
    with pytest.raises(RecordingError, match="step 2: GPU interval starts"):
        gpu_intervals(SimpleNamespace(gpu_start=start, gpu_end=end), 1e-6, chunk=2)  # type: ignore[arg-type]


def test_longest_sync_per_step() -> None:
    rng = np.random.default_rng(5)
    for _ in range(50):
        step = np.sort(rng.choice(40, size=int(rng.integers(1, 30)), replace=False))
        if rng.random() < 0.5:  # some steps wait more than once
            step = np.sort(np.concatenate((step, step[: int(rng.integers(0, step.size))])))
        dur = rng.choice([0.1, 0.2, 0.3], size=step.size)
        order = np.lexsort((-dur, step))  # by step, longest first, ties: the first recorded
        want = order[np.concatenate(([True], np.diff(step[order]) != 0))]
        assert np.array_equal(_longest_per_step(step, dur), want)
