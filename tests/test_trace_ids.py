"""Duplicate request ids: integer ids are checked without a hash table (their values are their
codes) and name the same row and first row as the dictionary-encoded check strings take."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from bubblesim.core.trace import TraceError, _check_unique, _Where


@pytest.mark.parametrize("seed", range(20))
def test_integer_ids_report_what_their_string_form_does(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 40, int(rng.integers(2, 60)))
    msgs = []
    for arr in (pa.array(ids, pa.int64()), pa.array([str(i) for i in ids])):
        try:
            _check_unique(arr, _Where("t"))
            msgs.append(None)
        except TraceError as e:
            msgs.append(str(e).replace("'", ""))
    assert msgs[0] == msgs[1]
    assert (msgs[0] is None) == (len(set(ids.tolist())) == len(ids))


def test_ascending_ids_pass_and_equal_neighbours_fail():
    _check_unique(pa.array(np.arange(10**5)), _Where("t"))
    want = r"row 3 column 'request_id': duplicate id 2 \(also row 2\)"
    with pytest.raises(TraceError, match=want):
        _check_unique(pa.array([0, 1, 2, 2, 5]), _Where("t"))
