"""timeline.json: the run in Chrome trace event format (open it in https://ui.perfetto.dev).

The same tracks for sim and replay, named by metadata events:
  pid 1 "CPU":      tid 1 "engine thread" (CPU phases and sync waits), tid 2 "gc pauses"
  pid 2 "GPU":      tid 1 "gpu stream" (one event per step), tid 2 "bubbles" (named by cause)
  pid 3 "requests": counter "requests in engine" (arrived, unfinished)
Complete events ("X") carry ts and dur in microseconds since the trace start. A long run is
exported as a window of `max_steps` steps (all of them with None) from the first step that
starts at or after `from_s`: every track keeps what starts in [from_s, the last time those steps
recorded), and `otherData` says which steps and times were exported.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import numpy as np

from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt.bubbles import CAUSES, Bubbles
from bubblesim.core.runfmt.recording import Recording
from bubblesim.core.runfmt.spill import release
from bubblesim.core.shape import SHAPE_FIELDS

# Steps exported to timeline.json: ~1.3 KB a step, so 5,000 steps are ~7 MB, which Perfetto opens
# at once; the cap cuts every track at the same time and `otherData` says so.
DEFAULT_MAX_STEPS = 5_000
PID_CPU, PID_GPU, PID_REQ = 1, 2, 3
TID_CPU, TID_GC = 1, 2
TID_GPU, TID_BUBBLE = 1, 2
TRACKS: tuple[tuple[int, int, str, str], ...] = (
    (PID_CPU, TID_CPU, "CPU", "engine thread"),
    (PID_CPU, TID_GC, "CPU", "gc pauses"),
    (PID_GPU, TID_GPU, "GPU", "gpu stream"),
    (PID_GPU, TID_BUBBLE, "GPU", "bubbles"),
    (PID_REQ, 1, "requests", "requests in engine"),
)
_GPU_ARGS = ("num_reqs", "prefill_tokens", "decode_tokens", "draft_tokens")


def us_values(t_s: np.ndarray) -> list[float]:
    """`round(t * 1e6, 3)` of each value (microseconds, to the nanosecond), as Python computes it
    (the nearest double to the decimal rounded half-even): numpy rounds the scaled values, which
    gives Python's result wherever the scaled value is not within a few ulps of a half (there
    rounding the product may flip the side), so those few go through Python's `round`."""
    x = np.asarray(t_s, np.float64) * 1e6
    y = x * 1e3
    q = np.rint(y)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, not sure
        sure = np.abs(np.abs(y - np.floor(y)) - 0.5) > np.abs(y) * 2.0**-48
    sure &= np.abs(y) < 2.0**50  # whole numbers and halves exact; nan and inf fail both tests
    out: list[float] = (q / 1e3).tolist()
    for i in np.flatnonzero(~sure).tolist():
        out[i] = round(float(x[i]), 3)
    return out


def _metadata() -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for pid, tid, proc, thread in TRACKS:
        if tid == 1:
            events.append(
                {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": proc}}
            )
            events.append(
                {
                    "ph": "M",
                    "pid": pid,
                    "tid": 0,
                    "name": "process_sort_index",
                    "args": {"sort_index": pid},
                }
            )
        events.append(
            {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}}
        )
        events.append(
            {
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "name": "thread_sort_index",
                "args": {"sort_index": tid},
            }
        )
    return events


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def _check_finite(values: list[float]) -> None:
    """As `json.dumps(..., allow_nan=False)` refuses a NaN or infinity."""
    if not all(map(math.isfinite, values)):
        raise ValueError("Out of range float values are not JSON compliant")


def _spans(
    name: str | list[str],
    cat: str,
    pid: int,
    tid: int,
    start: np.ndarray,
    end: np.ndarray,
    args_format: str,
    *args: list[Any],
) -> list[str]:
    """Complete ("X") events, each as `json.dumps(event, separators=(",", ":"))` writes it:
    `args_format` is the text of the args object with a %-format per value (%d for an int, %s
    for a string given JSON-quoted), filled from the columns `args`, one value an event each."""
    ts, dur = us_values(start), us_values(end - start)
    _check_finite(ts)
    _check_finite(dur)
    tail = f',"cat":{_dumps(cat)},"ph":"X","pid":{pid},"tid":{tid}'.replace("%", "%%")
    fmt = '{"name":%s' + tail + ',"ts":%r,"dur":%r,"args":' + args_format + "}"
    names = [_dumps(name)] * len(ts) if isinstance(name, str) else _quoted(name)
    return [fmt % row for row in zip(names, ts, dur, *args)]


def _quoted(strings: list[str]) -> list[str]:
    """Each string JSON-quoted (each distinct one quoted once)."""
    text = {x: _dumps(x) for x in set(strings)}
    return [text[x] for x in strings]


class Window(NamedTuple):
    """The steps [first_step, end_step) and the times [from_s, to_s) a timeline exports."""

    first_step: int
    end_step: int
    from_s: float
    to_s: float  # inf: to the end of the run


def step_starts(rec: Recording, chunk: int = 1 << 20) -> np.ndarray:
    """Each step's earliest recorded time (NaN for a step with none), `chunk` steps at a time."""
    n = rec.num_steps
    out = np.empty(n)
    for lo in range(0, n, chunk):
        cut = slice(lo, lo + chunk)
        out[cut] = np.fmin.reduce(np.column_stack((rec.phase_start[cut], rec.gpu_start[cut])), 1)
        release(rec.phase_start, rec.gpu_start)
    return out


def window(rec: Recording, max_steps: int | None, from_s: float = 0.0) -> Window:
    """`max_steps` steps (None: all) from the first step starting at or after `from_s`."""
    n = rec.num_steps
    later = np.flatnonzero(step_starts(rec) >= from_s) if from_s > 0 else np.arange(min(n, 1))
    k0 = int(later[0]) if later.size else n
    k1 = n if max_steps is None else min(n, k0 + max_steps)
    if k1 >= n:
        return Window(k0, k1, from_s, math.inf)
    ends = np.concatenate((rec.phase_end[:k1].ravel(), rec.gpu_end[:k1]))
    ends = ends[np.isfinite(ends)]
    return Window(k0, k1, from_s, float(ends.max()) if ends.size else -math.inf)


class Timeline(NamedTuple):
    """timeline.json's text and its `otherData` (what summary.json's `timeline` repeats)."""

    text: str
    other: dict[str, Any]


def build_timeline(
    rec: Recording,
    bub: Bubbles,
    source_kind: str,
    max_steps: int | None = DEFAULT_MAX_STEPS,
    from_s: float = 0.0,
) -> Timeline:
    """timeline.json as `json.dumps(trace, separators=(",", ":"), allow_nan=False)` writes the
    trace object {traceEvents, displayTimeUnit, otherData}: each event's text is formatted
    directly (a window of thousands of steps is ~100k events)."""
    w = window(rec, max_steps, from_s)
    lo, cut = w.from_s, w.to_s
    ev = [_dumps(e) for e in _metadata()]
    for j, p in enumerate(CPU_PHASES):
        s, e = rec.phase_start[:, j], rec.phase_end[:, j]
        steps = _starting_in(s, lo, cut)
        ev += _spans(p, "cpu", PID_CPU, TID_CPU, s[steps], e[steps], _STEP, steps.tolist())
        release(rec.phase_start, rec.phase_end)  # a spilled run's maps: one phase at a time
    ok = _starting_in(rec.sync_start, lo, cut)
    sync_steps = rec.sync_step[ok].tolist()
    ev += _spans(
        "sync", "sync", PID_CPU, TID_CPU, rec.sync_start[ok], rec.sync_end[ok], _STEP, sync_steps
    )
    ok = (rec.gc_start >= lo) & (rec.gc_start < cut)
    gc_end = rec.gc_start[ok] + rec.gc_dur[ok]
    gc_phase = _quoted(rec.gc_phase[ok].tolist())
    gc_args = (rec.gc_step[ok].tolist(), rec.gc_gen[ok].tolist(), gc_phase)
    ev += _spans("gc", "gc", PID_CPU, TID_GC, rec.gc_start[ok], gc_end, _GC_ARGS, *gc_args)
    ev += _gpu_events(rec, lo, cut)
    release(rec.sync_start, rec.sync_end, rec.sync_step, rec.gpu_start, rec.gpu_end, rec.shape)
    ok = (bub.piece_start >= lo) & (bub.piece_start < cut)
    names = [CAUSES[c] for c in bub.piece_cause[ok].tolist()]
    ev += _spans(names, "bubble", PID_GPU, TID_BUBBLE, bub.piece_start[ok], bub.piece_end[ok], "{}")
    ev += _request_counter(rec, bub.end_s, lo, cut)
    exported = w.end_step - w.first_step
    other = {
        "source": source_kind,
        "time_unit": "microseconds since trace start",
        "steps_total": rec.num_steps,
        "steps_exported": exported,
        "first_step": w.first_step,
        "last_step": w.end_step - 1 if exported else None,
        "from_s": lo,
        "to_s": cut if math.isfinite(cut) else None,  # None: to the end of the run
        "truncated": exported < rec.num_steps,
    }
    events = ",".join(ev)
    text = f'{{"traceEvents":[{events}],"displayTimeUnit":"ms","otherData":{_dumps(other)}}}'
    return Timeline(text, other)


def _starting_in(start_s: np.ndarray, lo: float, cut: float, chunk: int = 1 << 16) -> np.ndarray:
    """The rows whose (finite) start is in [lo, cut), ascending: a chunk at a time, in cache (a
    run of millions of steps exports a few thousand)."""
    found = [np.zeros(0, np.int64)]
    for c0 in range(0, start_s.size, chunk):
        x = start_s[c0 : c0 + chunk]
        hit = np.flatnonzero(np.isfinite(x) & (x >= lo) & (x < cut))
        if hit.size:
            found.append(hit + c0)
    return np.concatenate(found)


_STEP = '{"step":%d}'
_GC_ARGS = '{"step":%d,"generation":%d,"phase":%s}'
_GPU_ARGS_FORMAT = "{" + ",".join(f'"{k}":%d' for k in ("step", *_GPU_ARGS)) + "}"


def _gpu_events(rec: Recording, lo: float, cut: float) -> list[str]:
    g = rec.gpu_start
    steps = _starting_in(g, lo, cut)
    cols = [SHAPE_FIELDS.index(f) for f in _GPU_ARGS]
    shape = rec.shape[steps][:, cols]
    prefill = rec.shape[steps, SHAPE_FIELDS.index("num_prefill_reqs")] > 0
    names = np.where(prefill, "prefill", "decode").tolist()
    args = [steps.tolist(), *(shape[:, k].tolist() for k in range(len(cols)))]
    return _spans(
        names,
        "gpu",
        PID_GPU,
        TID_GPU,
        rec.gpu_start[steps],
        rec.gpu_end[steps],
        _GPU_ARGS_FORMAT,
        *args,
    )


def _request_counter(rec: Recording, end_s: float, lo: float, cut: float) -> list[str]:
    """A counter sample at every arrival and finish: arrived, unfinished requests (and, for a
    window that starts later, one at its start with the level then)."""
    finish = np.where(np.isnan(rec.finish), end_s, rec.finish)
    t = np.concatenate((rec.arrival, finish))
    delta = np.concatenate((np.ones(rec.arrival.size), -np.ones(finish.size)))
    order = np.lexsort((delta, t))  # at equal times, finishes before arrivals
    t, level = t[order], np.cumsum(delta[order])
    last = np.concatenate((t[1:] != t[:-1], [True])) if t.size else np.zeros(0, bool)
    keep = last & (t >= lo) & (t < cut)  # one sample per distinct time: the level after it
    if lo > 0 and t.size and t[0] < lo and not np.any(t == lo):
        before = np.flatnonzero(t < lo)[-1]  # the level at `lo`: after the last event before it
        t, level = np.concatenate(([lo], t)), np.concatenate(([level[before]], level))
        keep = np.concatenate(([True], keep))
    ts = us_values(t[keep])
    _check_finite(ts)
    fmt = f'{{"name":"requests in engine","ph":"C","pid":{PID_REQ},"tid":1,'
    fmt += '"ts":%r,"args":{"requests":%d}}'
    return [fmt % row for row in zip(ts, level[keep].astype(np.int64).tolist())]
