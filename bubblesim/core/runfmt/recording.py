"""`Recording`: a frozen run as numpy arrays (what `RunRecorder.freeze` returns), and the
checks every recording must pass before anything is computed or written from it.

Shapes: n = steps, r = requests, s = sync waits, g = GC pauses.
`shape` (n, len(SHAPE_FIELDS)) int64; `phase_start`/`phase_end` (n, len(CPU_PHASES)) with NaN
where a phase is absent; `gpu_start`/`gpu_end` (n,), NaN where a step has no GPU interval.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt.spill import release
from bubblesim.core.runfmt.stats import FloatArray

IntArray = np.ndarray


class RecordingError(ValueError):
    """Recorded data breaks an invariant; the message names the step or request row."""


@dataclass(frozen=True)
class Recording:
    shape: IntArray
    phase_start: FloatArray
    phase_end: FloatArray
    gpu_start: FloatArray
    gpu_end: FloatArray
    accepted: IntArray
    sync_start: FloatArray
    sync_end: FloatArray
    sync_step: IntArray
    gc_start: FloatArray
    gc_dur: FloatArray
    gc_gen: IntArray
    gc_phase: np.ndarray  # object array of str ("" = unknown)
    gc_step: IntArray
    request_id: list[Hashable]
    arrival: FloatArray
    first_token: FloatArray
    last_token: FloatArray
    finish: FloatArray
    output_tokens: IntArray
    preemptions: IntArray
    req_accepted: IntArray
    itl_quantiles: dict[str, float | None]
    itl_exact: bool

    @property
    def num_steps(self) -> int:
        return int(self.gpu_start.shape[0])

    @property
    def num_requests(self) -> int:
        return len(self.request_id)


def _fail_first(bad: np.ndarray, what: str) -> None:
    idx = np.flatnonzero(bad)
    if idx.size:
        raise RecordingError(what.format(i=int(idx[0])) + f" ({idx.size} such)")


# Recordings that passed `validate` as `RunRecorder.freeze(release=True)` made them (their
# arrays are the released recorder's, written by nobody since): write_run does not check them
# twice.
_VALID: weakref.WeakValueDictionary[int, Recording] = weakref.WeakValueDictionary()


def validate(rec: Recording, trusted: bool = False) -> None:
    """Raise RecordingError naming the first step/row that breaks an invariant. `trusted`:
    the caller made `rec` and nothing else holds it; once valid it is not checked again."""
    if _VALID.get(id(rec)) is rec:
        return
    _check(rec)
    if trusted:
        _VALID[id(rec)] = rec


def _check(rec: Recording) -> None:
    for j, name in enumerate(CPU_PHASES):
        s, e = rec.phase_start[:, j], rec.phase_end[:, j]
        _fail_first(np.isnan(s) != np.isnan(e), f"step {{i}}: phase {name!r} has one end only")
        _fail_first(e < s, f"step {{i}}: phase {name!r} ends before it starts")
        _fail_first(np.isinf(s) | np.isinf(e), f"step {{i}}: phase {name!r} time is infinite")
        release(rec.phase_start, rec.phase_end)  # a spilled run's maps: one column at a time
    gs, ge = rec.gpu_start, rec.gpu_end
    _fail_first(np.isnan(gs) != np.isnan(ge), "step {i}: GPU interval has one end only")
    _fail_first(ge < gs, "step {i}: GPU interval ends before it starts")
    _fail_first(np.isinf(gs) | np.isinf(ge), "step {i}: GPU time is infinite")
    release(gs, ge)
    _fail_first(~np.isfinite(rec.sync_start) | ~np.isfinite(rec.sync_end), "sync wait {i}: NaN")
    _fail_first(rec.sync_end < rec.sync_start, "sync wait {i}: ends before it starts")
    release(rec.sync_start, rec.sync_end)
    _fail_first(~np.isfinite(rec.gc_start) | ~np.isfinite(rec.gc_dur), "GC pause {i}: NaN")
    _fail_first(rec.gc_dur < 0, "GC pause {i}: negative duration")
    n = rec.num_steps
    _fail_first((rec.gc_step < -1) | (rec.gc_step >= n), "GC pause {i}: step out of range")
    _fail_first(rec.accepted < 0, "step {i}: negative accepted draft tokens")
    release(rec.gpu_start, rec.gpu_end, rec.accepted, rec.sync_start, rec.sync_end)

    _fail_first(~np.isfinite(rec.arrival), "request row {i}: arrival_s is not finite")
    _fail_first(rec.first_token < rec.arrival, "request row {i}: first token before arrival")
    _fail_first(rec.finish < rec.arrival, "request row {i}: finished before arrival")
    _fail_first(rec.finish < rec.last_token, "request row {i}: finished before its last token")
    ids = rec.request_id
    if len(set(ids)) != len(ids):
        seen: dict[Hashable, int] = {}
        for row, rid in enumerate(ids):
            if rid in seen:
                raise RecordingError(f"request row {row}: duplicate request_id {rid!r}")
            seen[rid] = row
