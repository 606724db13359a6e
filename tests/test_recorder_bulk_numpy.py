"""RunRecorder's bulk appends on their numpy paths (a fast-forward segment's many requests,
emission times and sync waits) record what the per-call methods record, and refuse the same
first bad range or emission."""

from __future__ import annotations

import numpy as np
import pytest

from bubblesim.core.runfmt import RunRecorder
from bubblesim.core.shape import BatchShape

REQUESTS, TIMES = 300, 200  # both above the recorder's numpy thresholds


def _frozen_equal(a: RunRecorder, b: RunRecorder) -> None:
    fa, fb = a.freeze(), b.freeze()
    for name in fa.__dataclass_fields__:
        x, y = getattr(fa, name), getattr(fb, name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            assert x == y, name


def _recorders(limit: int) -> tuple[RunRecorder, RunRecorder]:
    a, b = RunRecorder(itl_exact_limit=limit), RunRecorder(itl_exact_limit=limit)
    for r in (a, b):
        for i in range(REQUESTS):
            r.add_request(i, 0.0)
        for i in range(0, REQUESTS, 3):  # a third emitted before the bulk call
            r.tokens(i, 0.25 + 0.001 * i)
    return a, b


@pytest.mark.parametrize("limit", [1 << 20, 50])  # 50: the ITL sketch folds mid-way
def test_tokens_ranges_of_many_requests_match_per_call(limit: int) -> None:
    rng = np.random.default_rng(limit)
    a, b = _recorders(limit)
    times = np.cumsum(rng.choice([0.0, 0.01, 0.02], TIMES)) + 1.0  # ascending, some equal
    reqs = rng.permutation(REQUESTS)[:250].tolist()  # distinct, not in row order
    starts = rng.integers(0, TIMES, len(reqs))
    stops = np.minimum(starts + rng.integers(0, 60, len(reqs)), TIMES)  # some empty
    for i, t in enumerate(times.tolist()):  # per call: time order, request order within a time
        for r, i0, i1 in zip(reqs, starts.tolist(), stops.tolist()):
            if i0 <= i < i1:
                a.tokens(r, t)
    b.tokens_ranges(reqs, starts.tolist(), stops.tolist(), times.tolist())
    _frozen_equal(a, b)


def test_tokens_ranges_of_many_requests_refuse_the_first_bad_one() -> None:
    times = [1.0 + 0.01 * i for i in range(TIMES)]
    reqs = list(range(100))
    starts, stops = [0] * 100, [5] * 100
    stops[40] = TIMES + 1  # a range past the times
    _, b = _recorders(1 << 20)
    with pytest.raises(IndexError, match="request row 40: range 0..201"):
        b.tokens_ranges(reqs, starts, stops, times)
    _, b = _recorders(1 << 20)
    b.tokens(30, 5.0)  # request 30 already emitted after the range's first time
    with pytest.raises(ValueError, match="request row 30: emission at 1.0 before the last"):
        b.tokens_ranges(reqs, starts, stops, times)


def test_many_sync_waits_match_per_call() -> None:
    a, b = RunRecorder(), RunRecorder()
    shape = BatchShape(num_reqs=1, decode_tokens=1, kv_read_tokens=10)
    for r in (a, b):
        for _ in range(150):
            r.add_step(shape)
    waits = [(i, 0.1 * i, 0.1 * i + 0.05) for i in range(150)]
    for step, s0, s1 in waits:
        a.sync(step, s0, s1)
    steps, starts, ends = (list(x) for x in zip(*waits))
    b.syncs(steps, starts, ends)
    _frozen_equal(a, b)
