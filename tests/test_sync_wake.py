"""`sync_wait.wake_ms`: a host that waits for a GPU event resumes that long after it (measured
~0.5 ms on an H100 host). The step loop and both fast-forwards apply it identically, for the
token wait, the accepted-counts wait (seed 5 off) and the CPU proposer's wait."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.ffcheck import assert_same_records, records_without_and_with_fast_forward
from tests.test_sim import trace_file

CASES = {
    "plain-depth1": ["batches_in_flight=1"],
    "plain-depth2": [],
    "ngram-gpu-wait-counts": ["spec.method=ngram-gpu", "optimistic_spec_decode=false"],
    "ngram-cpu": ["spec.method=ngram-cpu"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_forward_applies_the_wake_like_the_step_loop(tmp_path: Path, case: str) -> None:
    n = 16
    trace = trace_file(tmp_path, "t", np.zeros(n), 300, np.full(n, 90))
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"version": 1, "sync_wait": {"wake_ms": 0.4}}))
    sets = ["model=llama3.2-1b", "gpu=h100", f"profile={prof}", *CASES[case]]
    off, on = records_without_and_with_fast_forward(sets, trace)
    assert_same_records(off, on, case)
    base, _ = records_without_and_with_fast_forward(sets[:2] + CASES[case], trace)
    if case == "plain-depth1":  # every step waits for its tokens: the wake is on the path
        span = np.nanmax(off.gpu_end) - np.nanmin(off.gpu_start)
        base_span = np.nanmax(base.gpu_end) - np.nanmin(base.gpu_start)
        assert span > base_span * 1.1
