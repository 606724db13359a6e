"""SortedIntervals.near: every interval that overlaps one of the gaps, in order, and nothing
that `window` over all the gaps would not hold (bubble accounting reads only these)."""

from __future__ import annotations

import numpy as np
import pytest

from bubblesim.core.runfmt.intervals import SortedIntervals


def _gaps(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    cuts = np.sort(rng.uniform(0, 100, 2 * n))
    return cuts[0::2], cuts[1::2]  # disjoint, ascending


@pytest.mark.parametrize("seed", range(20))
def test_near_holds_every_overlapping_interval_in_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    starts = rng.uniform(-5, 105, n)
    ends = starts + rng.exponential(rng.choice([0.1, 3.0, 30.0]), n)
    iv = SortedIntervals.of(starts, ends)
    gs, ge = _gaps(rng, int(rng.integers(1, 12)))
    s, e = iv.near(gs, ge)
    pos = np.searchsorted(iv.starts, s)  # starts may repeat: match (start, end) pairs
    got = list(zip(s.tolist(), e.tolist()))
    assert len(set(got)) == len(got)
    assert np.all(np.diff(pos) >= 0)  # in the intervals' order
    overlap = [
        (a, b) for a, b in zip(iv.starts.tolist(), iv.ends.tolist())
        if np.any((a < ge) & (b > gs))
    ]  # fmt: skip
    assert set(overlap) <= set(got)
    ws, we = iv.window(float(gs[0]), float(ge[-1]))
    assert set(got) <= set(zip(ws.tolist(), we.tolist()))


def test_near_of_no_overlap_is_empty() -> None:
    iv = SortedIntervals.of(np.array([0.0, 10.0]), np.array([1.0, 11.0]))
    s, e = iv.near(np.array([2.0, 5.0]), np.array([3.0, 6.0]))
    assert s.size == e.size == 0
