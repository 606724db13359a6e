"""Scheduler.admission_blocked (admit skips a retry of its head request that is known to fail)
changes no result: preemption-heavy runs, step loop and fast path, with and without prefix
sharing, give the same records as with every retry made."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.policy import Scheduler
from bubblesim.core.trace import make_trace, write_trace
from sim.loop import SimLoop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records  # noqa: E402


def _trace(tmp: Path, prefixes: bool) -> Path:
    rng = np.random.default_rng(3)
    n = 80
    cols = {}
    if prefixes:
        group = rng.integers(0, 3, n).astype(np.int32)
        cols = {
            "prefix_group": group,
            "prefix_keys": np.array(["a", "b", "c"], dtype=object),
            "prefix_len": np.full(n, 64, dtype=np.int32),
        }
    t = make_trace(
        np.sort(rng.uniform(0, 1.0, n)), rng.integers(70, 400, n), rng.integers(1, 200, n), **cols
    )
    return write_trace(t, tmp / f"t{int(prefixes)}.parquet")


@pytest.mark.parametrize("prefixes", [False, True])
@pytest.mark.parametrize("fast", [False, True])
def test_skipped_retries_change_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefixes: bool, fast: bool
) -> None:
    trace = _trace(tmp_path, prefixes)
    sets = ["model=llama3-8b", "num_kv_blocks=60", "max_num_batched_tokens=512"]
    monkeypatch.setattr(simrun, "SimLoop", functools.partial(SimLoop, fast_forward=fast))
    recs, preempted = [], []
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(Scheduler, "admission_blocked", lambda self, budget: False)
        res = simrun.simulate(load_config(None, sets), trace)
        recs.append(res.recorder.freeze())
        preempted.append(int(recs[-1].preemptions.sum()))
    assert preempted[0] > 0  # the cache ran full: retries happened
    assert_same_records(recs[0], recs[1], f"prefixes={prefixes} fast={fast}")
