"""timeline.json: the run in Chrome trace event format (open it in https://ui.perfetto.dev).

The same tracks for sim and replay, named by metadata events:
  pid 1 "CPU":      tid 1 "engine thread" (CPU phases and sync waits), tid 2 "gc pauses"
  pid 2 "GPU":      tid 1 "gpu stream" (one event per step), tid 2 "bubbles" (named by cause)
  pid 3 "requests": counter "requests in engine" (arrived, unfinished)
Complete events ("X") carry ts and dur in microseconds since the trace start. A long run is cut
to its first `max_steps` steps: every track stops at the last time those steps recorded, and
`otherData` says how many steps were exported.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from core.phases import CPU_PHASES
from core.runfmt.bubbles import CAUSES, Bubbles
from core.runfmt.recording import Recording
from core.shape import SHAPE_FIELDS

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


def _us(t: float) -> float:
    return round(t * 1e6, 3)


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


def _spans(
    name: str | list[str],
    cat: str,
    pid: int,
    tid: int,
    start: np.ndarray,
    end: np.ndarray,
    args: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    names = [name] * len(args) if isinstance(name, str) else name
    return [
        {
            "name": nm,
            "cat": cat,
            "ph": "X",
            "pid": pid,
            "tid": tid,
            "ts": _us(s),
            "dur": _us(e - s),
            "args": a,
        }
        for nm, s, e, a in zip(names, start.tolist(), end.tolist(), args)
    ]


def cut_time(rec: Recording, max_steps: int) -> float:
    """The last time the first `max_steps` steps recorded (inf when nothing is cut)."""
    if rec.num_steps <= max_steps:
        return math.inf
    k = max_steps
    ends = np.concatenate((rec.phase_end[:k].ravel(), rec.gpu_end[:k]))
    ends = ends[np.isfinite(ends)]
    return float(ends.max()) if ends.size else -math.inf


def build_timeline(
    rec: Recording, bub: Bubbles, source_kind: str, max_steps: int = DEFAULT_MAX_STEPS
) -> dict[str, Any]:
    cut = cut_time(rec, max_steps)
    ev = _metadata()
    for j, p in enumerate(CPU_PHASES):
        s, e = rec.phase_start[:, j], rec.phase_end[:, j]
        steps = np.flatnonzero(np.isfinite(s) & (s < cut))
        ev += _spans(
            p, "cpu", PID_CPU, TID_CPU, s[steps], e[steps], [{"step": i} for i in steps.tolist()]
        )
    ok = rec.sync_start < cut
    ev += _spans(
        "sync",
        "sync",
        PID_CPU,
        TID_CPU,
        rec.sync_start[ok],
        rec.sync_end[ok],
        [{"step": i} for i in rec.sync_step[ok].tolist()],
    )
    ok = rec.gc_start < cut
    gc_args = [
        {"step": st, "generation": g, "phase": ph}
        for st, g, ph in zip(
            rec.gc_step[ok].tolist(), rec.gc_gen[ok].tolist(), rec.gc_phase[ok].tolist()
        )
    ]
    ev += _spans(
        "gc", "gc", PID_CPU, TID_GC, rec.gc_start[ok], rec.gc_start[ok] + rec.gc_dur[ok], gc_args
    )
    ev += _gpu_events(rec, cut)
    ok = bub.piece_start < cut
    names = [CAUSES[c] for c in bub.piece_cause[ok].tolist()]
    ev += _spans(
        names,
        "bubble",
        PID_GPU,
        TID_BUBBLE,
        bub.piece_start[ok],
        bub.piece_end[ok],
        [{}] * len(names),
    )
    ev += _request_counter(rec, bub.end_s, cut)
    exported = min(rec.num_steps, max_steps)
    return {
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": source_kind,
            "time_unit": "microseconds since trace start",
            "steps_total": rec.num_steps,
            "steps_exported": exported,
            "truncated": exported < rec.num_steps,
        },
    }


def _gpu_events(rec: Recording, cut: float) -> list[dict[str, Any]]:
    steps = np.flatnonzero(np.isfinite(rec.gpu_start) & (rec.gpu_start < cut))
    cols = [SHAPE_FIELDS.index(f) for f in _GPU_ARGS]
    shape = rec.shape[steps][:, cols].tolist()
    prefill = rec.shape[steps, SHAPE_FIELDS.index("num_prefill_reqs")] > 0
    names = np.where(prefill, "prefill", "decode").tolist()
    args = [{"step": i, **dict(zip(_GPU_ARGS, row))} for i, row in zip(steps.tolist(), shape)]
    return _spans(names, "gpu", PID_GPU, TID_GPU, rec.gpu_start[steps], rec.gpu_end[steps], args)


def _request_counter(rec: Recording, end_s: float, cut: float) -> list[dict[str, Any]]:
    """A counter sample at every arrival and finish: arrived, unfinished requests."""
    finish = np.where(np.isnan(rec.finish), end_s, rec.finish)
    t = np.concatenate((rec.arrival, finish))
    delta = np.concatenate((np.ones(rec.arrival.size), -np.ones(finish.size)))
    order = np.lexsort((delta, t))  # at equal times, finishes before arrivals
    t, level = t[order], np.cumsum(delta[order])
    last = np.concatenate((t[1:] != t[:-1], [True])) if t.size else np.zeros(0, bool)
    keep = last & (t < cut)  # one sample per distinct time: the level after all its events
    return [
        {
            "name": "requests in engine",
            "ph": "C",
            "pid": PID_REQ,
            "tid": 1,
            "ts": _us(x),
            "args": {"requests": int(v)},
        }
        for x, v in zip(t[keep].tolist(), level[keep].tolist())
    ]
