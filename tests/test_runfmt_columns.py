"""The run folder's fast paths give what the general ones give: the longest sync wait per step
without a sort when waits come in step order, and the recording's step columns column-major
(contiguous, taken by the tables without a copy) with the values row-major ones had."""

from __future__ import annotations

import numpy as np
import pytest

from bubblesim.core.runfmt.records import RunRecorder
from bubblesim.core.runfmt.tables import _longest_per_step
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape


def _by_sort(step: np.ndarray, dur: np.ndarray) -> np.ndarray:
    order = np.lexsort((-dur, step))
    return np.sort(order[np.concatenate(([True], np.diff(step[order]) != 0))])


@pytest.mark.parametrize("seed", range(40))
def test_longest_per_step_matches_the_sort(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    step = np.sort(rng.integers(0, max(1, n // 3), n))
    dur = rng.choice([0.1, 0.2, 0.3], n) if seed % 2 else rng.random(n)  # ties, or none
    if seed % 5 == 0:
        step = rng.permutation(step)  # not in step order: the sort
    if seed % 7 == 0:
        dur[rng.integers(0, n)] = np.nan
    assert np.array_equal(np.sort(_longest_per_step(step, dur)), _by_sort(step, dur))


def test_frozen_step_columns_are_contiguous_and_exact() -> None:
    rec = RunRecorder(chunk_steps=4)
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 1000, (11, len(SHAPE_FIELDS)))
    for i, row in enumerate(rows):
        step = rec.add_step(BatchShape(*map(int, row)))
        rec.phase(step, "schedule", i + 0.1, i + 0.2)
        if i % 2:
            rec.phase(step, "launch", i + 0.3, i + 0.4)
    rec.add_steps(
        rows[:5], {"schedule": ([20.0 + k for k in range(5)], [20.5 + k for k in range(5)])}
    )
    fr = rec.freeze()
    assert np.array_equal(fr.shape, np.concatenate((rows, rows[:5])))
    assert all(fr.shape[:, j].flags.c_contiguous for j in range(len(SHAPE_FIELDS)))
    assert all(fr.phase_start[:, j].flags.c_contiguous for j in range(fr.phase_start.shape[1]))
    assert fr.phase_start[3, 0] == 3.1 and np.isnan(fr.phase_start[2, 2])
    assert fr.phase_end[13, 0] == 22.5


@pytest.mark.parametrize("seed", range(6))
def test_tokens_ranges_in_numpy_keeps_the_same_gaps(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over many emission times tokens_ranges works in numpy: the same ITL entries, in the
    same order, and the same per-request columns as its per-time loop."""
    import bubblesim.core.runfmt.records as records

    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(0.01, 300)).tolist()
    reqs = list(range(40))
    starts = rng.integers(0, 300, 40)
    stops = np.minimum(starts + rng.integers(0, 120, 40), 300)
    recs = []
    for limit in (1 << 30, 64):  # the loop, then numpy
        monkeypatch.setattr(records, "_VECTOR_TIMES", limit)
        rec = RunRecorder()
        for r in reqs:
            rec.add_request(r, 0.0)
        rec.tokens(3, 0.0)  # a request with an earlier emission: one gap of its own
        rec.tokens_ranges(reqs, starts.tolist(), stops.tolist(), times)
        recs.append(rec)
    a, b = recs
    assert a._itl_v.tobytes() == b._itl_v.tobytes() and a._itl_w == b._itl_w
    assert a._itl_entries == b._itl_entries
    assert a._last.tobytes() == b._last.tobytes() and a._out == b._out
    assert a._first.tobytes() == b._first.tobytes()
    with pytest.raises(ValueError, match="ascending"):
        b.tokens_ranges([5], [0], [2], [*times[:100], 0.0])


def test_add_requests_is_add_request_in_order() -> None:
    a, b = RunRecorder(), RunRecorder()
    ids: list[object] = [5, "x", 7, 8]
    arrivals = [0.0, 0.25, 0.25, 1.5]
    for i, t in zip(ids, arrivals):
        a.add_request(i, t)
    assert b.add_requests(ids[:1], arrivals[:1]) == 0
    assert b.add_requests(ids[1:], arrivals[1:]) == 1
    a.tokens(2, 1.0)
    b.tokens(2, 1.0)
    fa, fb = a.freeze(), b.freeze()
    assert fa.request_id == fb.request_id == ids
    for col in ("arrival", "first_token", "last_token", "finish"):
        assert getattr(fa, col).tobytes() == getattr(fb, col).tobytes()
    for col in ("output_tokens", "preemptions", "req_accepted"):
        assert np.array_equal(getattr(fa, col), getattr(fb, col))
    with pytest.raises(ValueError, match="differ in length"):
        b.add_requests([1], [])


def test_freeze_release_drops_the_columns_and_refuses_more() -> None:
    rec = RunRecorder()
    rec.add_requests([1, 2], [0.0, 0.5])
    step = rec.add_step(BatchShape(*range(len(SHAPE_FIELDS))))
    rec.phase(step, "schedule", 0.0, 0.1)
    rec.tokens(0, 0.2)
    fr = rec.freeze(release=True)
    assert rec.freeze() is fr  # the same recording from then on
    assert rec.num_requests == 2 and rec.num_steps == 1
    assert fr.phase_end[0, 0] == 0.1 and fr.output_tokens.tolist() == [1, 0]
    for record in (
        lambda: rec.add_step(BatchShape(*range(len(SHAPE_FIELDS)))),
        lambda: rec.phase(0, "launch", 0.1, 0.2),
        lambda: rec.tokens(1, 1.0),
        lambda: rec.add_request(3, 1.0),
    ):
        with pytest.raises(RuntimeError, match="release=True"):
            record()
