"""RunRecorder's read-only views and LogHistogram.merge (issue 15: the plan reads these instead
of the recorder's private columns)."""

from __future__ import annotations

import numpy as np
import pytest

from bubblesim.core.runfmt import RunRecorder
from bubblesim.core.runfmt.sketch import LogHistogram
from bubblesim.plan.recview import merged_itl_quantiles, request_columns


def _recorder(itl_exact_limit: int = 1 << 20) -> RunRecorder:
    rec = RunRecorder(itl_exact_limit=itl_exact_limit)
    rec.add_requests(["a", "b"], [0.5, 1.0])
    return rec


def test_request_views_see_later_stores_and_are_read_only():
    rec = _recorder()
    cols = request_columns(rec)
    assert cols.arrival.tolist() == [0.5, 1.0]
    assert np.isnan(cols.first_token).all() and cols.output_tokens.tolist() == [0, 0]
    rec.tokens(0, 2.0)
    rec.tokens(0, 2.5, n=2)
    rec.finish(0, 3.0)
    # zero-copy: the views made before the stores see them
    assert cols.first_token[0] == 2.0 and cols.last_token[0] == 2.5
    assert cols.finish[0] == 3.0 and np.isnan(cols.finish[1])
    assert cols.output_tokens.tolist() == [3, 0]
    for v in (rec.arrival_s, rec.first_token_s, rec.last_token_s, rec.finish_s):
        assert v.dtype == np.float64 and not v.flags.writeable
    assert rec.output_tokens.dtype == np.int64
    with pytest.raises(ValueError):
        rec.finish_s[1] = 9.0


def test_itl_views_exact_then_folded():
    rec = _recorder()
    rec.tokens(0, 1.0)
    rec.tokens(0, 1.5, n=2)
    v, w = rec.itl_samples
    assert v.tolist() == [0.25] and w.tolist() == [2] and not v.flags.writeable
    assert rec.itl_histogram is None
    del v, w  # a live view pins the column: recording more needs it gone
    folded = _recorder(itl_exact_limit=2)
    for t in (1.0, 2.0, 3.0, 4.0):
        folded.tokens(0, t)
    hist = folded.itl_histogram
    assert hist is not None and hist.count == 2  # two gaps folded, the third still exact
    assert folded.itl_samples[1].tolist() == [1]


def test_merge_equals_adding_the_values():
    vals = np.array([0.0, 1e-3, 2e-3, 0.5, 7.0])
    a, b, both = LogHistogram(), LogHistogram(), LogHistogram()
    a.add(vals[:2])
    b.add(vals[2:], np.array([1, 2, 3]))
    both.add(vals, np.array([1, 1, 1, 2, 3]))
    a.merge(b)
    assert a.count == both.count == 8
    assert np.array_equal(a.quantiles([0.1, 0.5, 0.99]), both.quantiles([0.1, 0.5, 0.99]))
    with pytest.raises(ValueError, match="rel_err"):
        a.merge(LogHistogram(rel_err=1e-2))


def test_merged_itl_quantiles_mixes_exact_and_folded_recorders():
    exact, folded = _recorder(), _recorder(itl_exact_limit=2)
    for t in (1.0, 1.1, 1.3):
        exact.tokens(1, t)
    for t in (1.0, 2.0, 3.0, 4.0):
        folded.tokens(0, t)
    for r in (exact, folded):
        r.freeze()
    q = merged_itl_quantiles([exact, folded])
    # gaps 0.1, 0.2, 1, 1, 1: the median is 1 (within the histogram's 0.1 %)
    assert q["p50"] == pytest.approx(1.0, rel=1.01e-3)
    assert merged_itl_quantiles([exact, exact])["p50"] == pytest.approx(0.15)


def test_views_of_a_released_recorder_refuse():
    rec = _recorder()
    rec.freeze(release=True)
    for name in ("arrival_s", "finish_s", "output_tokens", "itl_samples", "itl_histogram"):
        with pytest.raises(RuntimeError, match="release=True"):
            getattr(rec, name)
