"""Bubble accounting's shortcuts give what the general code gives: `_overlapping` of ascending
intervals (a step loop's) searched per gap, and `measure_upto` computed in place."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblesim.core.runfmt.bubbles import _overlapping
from bubblesim.core.runfmt.intervals import measure_upto, union


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
