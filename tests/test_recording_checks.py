"""`validate` checks a recording's step and sync-wait columns a chunk of rows at a time: the
first failing check, its first row and its count are the ones the whole-column checks give."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import recording
from bubblesim.core.runfmt.recording import Recording, RecordingError


def _reference(rec: Recording) -> str | None:
    """The checks as whole-column numpy, before chunking: the first failure's message."""

    def first(bad: np.ndarray, what: str) -> str | None:
        idx = np.flatnonzero(bad)
        return what.format(i=int(idx[0])) + f" ({idx.size} such)" if idx.size else None

    checks: list[tuple[np.ndarray, str]] = []
    for j, name in enumerate(CPU_PHASES):
        s, e = rec.phase_start[:, j], rec.phase_end[:, j]
        checks += [
            (np.isnan(s) != np.isnan(e), f"step {{i}}: phase {name!r} has one end only"),
            (e < s, f"step {{i}}: phase {name!r} ends before it starts"),
            (np.isinf(s) | np.isinf(e), f"step {{i}}: phase {name!r} time is infinite"),
        ]
    gs, ge = rec.gpu_start, rec.gpu_end
    checks += [
        (np.isnan(gs) != np.isnan(ge), "step {i}: GPU interval has one end only"),
        (ge < gs, "step {i}: GPU interval ends before it starts"),
        (np.isinf(gs) | np.isinf(ge), "step {i}: GPU time is infinite"),
        (~np.isfinite(rec.sync_start) | ~np.isfinite(rec.sync_end), "sync wait {i}: NaN"),
        (rec.sync_end < rec.sync_start, "sync wait {i}: ends before it starts"),
        (~np.isfinite(rec.gc_start) | ~np.isfinite(rec.gc_dur), "GC pause {i}: NaN"),
        (rec.gc_dur < 0, "GC pause {i}: negative duration"),
        ((rec.gc_step < -1) | (rec.gc_step >= rec.num_steps), "GC pause {i}: step out of range"),
        (rec.accepted < 0, "step {i}: negative accepted draft tokens"),
    ]
    for bad, what in checks:
        msg = first(bad, what)
        if msg is not None:
            return msg
    return None


def _recording(rng: np.random.Generator, n: int, m: int, spoil: int) -> Recording:
    k = len(CPU_PHASES)
    start = rng.uniform(0, 100, (n, k))
    end = start + rng.uniform(0, 1, (n, k))
    skip = rng.random((n, k)) < 0.2
    start[skip] = end[skip] = np.nan
    gs = rng.uniform(0, 100, n)
    ge = gs + 1.0
    ss = rng.uniform(0, 100, m)
    se = ss + 0.5
    acc = rng.integers(0, 3, n)
    cols = [start, end, gs, ge, ss, se]
    for _ in range(spoil):  # a few bad values anywhere
        which = int(rng.integers(0, len(cols) + 1))
        if which == len(cols):
            if n:
                acc[int(rng.integers(0, n))] = -1
            continue
        col = cols[which]
        if col.size:
            flat = col.reshape(-1)
            flat[int(rng.integers(0, flat.size))] = rng.choice([np.nan, np.inf, -5.0, 1e9])
    z = np.zeros(0)
    return Recording(
        shape=np.zeros((n, 1), np.int64),
        phase_start=np.asfortranarray(start),
        phase_end=np.asfortranarray(end),
        gpu_start=gs,
        gpu_end=ge,
        accepted=acc,
        sync_start=ss,
        sync_end=se,
        sync_step=np.zeros(m, np.int64),
        gc_start=z,
        gc_dur=z,
        gc_gen=np.zeros(0, np.int64),
        gc_phase=np.zeros(0, object),
        gc_step=np.zeros(0, np.int64),
        request_id=[],
        arrival=z,
        first_token=z,
        last_token=z,
        finish=z,
        output_tokens=np.zeros(0, np.int64),
        preemptions=np.zeros(0, np.int64),
        req_accepted=np.zeros(0, np.int64),
        itl_quantiles={},
        itl_exact=True,
    )


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 60), st.integers(0, 40), st.integers(0, 4))
def test_chunked_checks_fail_as_whole_columns(seed: int, n: int, m: int, spoil: int) -> None:
    rec = _recording(np.random.default_rng(seed), n, m, spoil)
    want = _reference(rec)
    saved = recording._CHECK_ROWS, recording._RELEASE_ROWS
    recording._CHECK_ROWS, recording._RELEASE_ROWS = 7, 14  # many chunks
    try:
        if want is None:
            recording._check(rec)
        else:
            with pytest.raises(RecordingError) as err:
                recording._check(rec)
            assert str(err.value) == want
    finally:
        recording._CHECK_ROWS, recording._RELEASE_ROWS = saved
