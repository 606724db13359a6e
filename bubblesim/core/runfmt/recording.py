"""`Recording`: a frozen run as numpy arrays (what `RunRecorder.freeze` returns), and the
checks every recording must pass before anything is computed or written from it.

Shapes: n = steps, r = requests, s = sync waits, g = GC pauses.
`shape` (n, len(SHAPE_FIELDS)) int64; `phase_start`/`phase_end` (n, len(CPU_PHASES)) with NaN
where a phase is absent; `gpu_start`/`gpu_end` (n,), NaN where a step has no GPU interval.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
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


def _fail_count(count: int, first: int, what: str) -> None:
    if count:
        raise RecordingError(what.format(i=first) + f" ({count} such)")


_CHECK_ROWS = 1 << 16  # rows checked at a time
_RELEASE_ROWS = 1 << 18  # a spilled run's maps are released this often (bounded memory)


def _scan(
    n: int, checks: Callable[[slice], list[np.ndarray]], maps: tuple[np.ndarray, ...]
) -> list[tuple[int, int]]:
    """(rows failing, first failing row; -1 for none) of each boolean check `checks(rows)`
    gives, over rows [0, n) a chunk at a time."""
    found = [[0, -1] for _ in checks(slice(0, 0))]
    for c0 in range(0, n, _CHECK_ROWS):
        bad = checks(slice(c0, c0 + _CHECK_ROWS))
        for f, b in zip(found, bad):
            k = int(np.count_nonzero(b))
            if k:
                f[0] += k
                f[1] = c0 + int(np.argmax(b)) if f[1] < 0 else f[1]
        if (c0 + _CHECK_ROWS) % _RELEASE_ROWS == 0:
            release(*maps)
    release(*maps)
    return [(count, first) for count, first in found]


def _step_checks(rec: Recording, c: slice) -> list[np.ndarray]:
    """Rows of `c` failing each per-step check, phases then GPU then accepted."""
    out = []
    for j in range(len(CPU_PHASES)):
        s, e = rec.phase_start[c, j], rec.phase_end[c, j]
        out += [np.isnan(s) != np.isnan(e), e < s, np.isinf(s) | np.isinf(e)]
    gs, ge = rec.gpu_start[c], rec.gpu_end[c]
    out += [np.isnan(gs) != np.isnan(ge), ge < gs, np.isinf(gs) | np.isinf(ge)]
    out.append(rec.accepted[c] < 0)
    return out


def _sync_checks(rec: Recording, c: slice) -> list[np.ndarray]:
    s, e = rec.sync_start[c], rec.sync_end[c]
    return [~np.isfinite(s) | ~np.isfinite(e), e < s]


def _step_maps(rec: Recording) -> tuple[np.ndarray, ...]:
    return (rec.phase_start, rec.phase_end, rec.gpu_start, rec.gpu_end, rec.accepted)


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
    # every per-step and per-sync-wait check, a chunk of rows at a time (the columns of a
    # chunk stay in cache, no run-sized temporaries); the first check that fails raises, in
    # the order below, naming its first row
    found = _scan(rec.num_steps, lambda c: _step_checks(rec, c), _step_maps(rec))
    syncs = _scan(
        rec.sync_start.size, lambda c: _sync_checks(rec, c), (rec.sync_start, rec.sync_end)
    )
    whats = [
        what
        for name in CPU_PHASES
        for what in (
            f"step {{i}}: phase {name!r} has one end only",
            f"step {{i}}: phase {name!r} ends before it starts",
            f"step {{i}}: phase {name!r} time is infinite",
        )
    ]
    whats += [
        "step {i}: GPU interval has one end only",
        "step {i}: GPU interval ends before it starts",
        "step {i}: GPU time is infinite",
    ]
    for what, (count, first) in zip(whats, found):
        _fail_count(count, first, what)
    for what, (count, first) in zip(
        ("sync wait {i}: NaN", "sync wait {i}: ends before it starts"), syncs
    ):
        _fail_count(count, first, what)
    _fail_first(~np.isfinite(rec.gc_start) | ~np.isfinite(rec.gc_dur), "GC pause {i}: NaN")
    _fail_first(rec.gc_dur < 0, "GC pause {i}: negative duration")
    n = rec.num_steps
    _fail_first((rec.gc_step < -1) | (rec.gc_step >= n), "GC pause {i}: step out of range")
    _fail_count(*found[-1], "step {i}: negative accepted draft tokens")

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
