"""The run's parquet tables built from a `Recording` and its `Bubbles` (Contract 3).

Times are float64 seconds since the trace start, NaN where absent (a phase a step skipped, a
request that never finished); counts are int64.
"""

from __future__ import annotations

from numbers import Integral

import numpy as np
import pyarrow as pa

from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt.bubbles import CAUSES, Bubbles
from bubblesim.core.runfmt.recording import Recording
from bubblesim.core.shape import SHAPE_FIELDS

REQUEST_COLUMNS: tuple[str, ...] = (
    "request_id",
    "arrival_s",
    "first_token_s",
    "finish_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "output_tokens",
    "preemptions",
    "accepted_draft_tokens",
)
PHASE_COLUMNS: tuple[str, ...] = tuple(
    f"{p}_{end}_s" for p in CPU_PHASES for end in ("start", "end")
)
STEP_COLUMNS: tuple[str, ...] = (
    "step",
    *SHAPE_FIELDS,
    *PHASE_COLUMNS,
    "sync_start_s",  # the longest sync wait of the step
    "sync_end_s",
    "sync_s",  # all sync waits of the step
    "sync_count",
    "gpu_start_s",
    "gpu_end_s",
    "gc_s",
    "gc_count",
    "gpu_idle_before_s",
    "bubble_before_s",
    "bubble_cause",
    "accepted_draft_tokens",
)
GC_COLUMNS: tuple[str, ...] = ("start_s", "duration_s", "generation", "phase", "step")


def request_id_array(ids: list[object]) -> pa.Array:
    """int64 when every id is an integer, else strings."""
    if all(type(i) is int for i in ids):  # the common case, without the ABC check per id
        return pa.array(ids, pa.int64())
    if all(isinstance(i, Integral) and not isinstance(i, bool) for i in ids):
        return pa.array([int(i) for i in ids], pa.int64())  # type: ignore[call-overload]
    return pa.array([str(i) for i in ids], pa.string())


def tpot_s(rec: Recording) -> np.ndarray:
    """Mean inter-token time after the first token; NaN with fewer than 2 tokens."""
    gaps = rec.output_tokens - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(gaps > 0, (rec.last_token - rec.first_token) / np.maximum(gaps, 1), np.nan)


def requests_table(rec: Recording) -> pa.Table:
    cols = {
        "request_id": request_id_array(list(rec.request_id)),
        "arrival_s": rec.arrival,
        "first_token_s": rec.first_token,
        "finish_s": rec.finish,
        "ttft_s": rec.first_token - rec.arrival,
        "tpot_s": tpot_s(rec),
        "e2e_s": rec.finish - rec.arrival,
        "output_tokens": rec.output_tokens,
        "preemptions": rec.preemptions,
        "accepted_draft_tokens": rec.req_accepted,
    }
    return pa.table(cols)


def steps_table(
    rec: Recording,
    bub: Bubbles,
    lo: int = 0,
    hi: int | None = None,
    sync_sorted: bool | None = None,
    cause: bool = True,
) -> pa.Table:
    """The steps [lo, hi) (all by default): each row as in the whole table. `sync_sorted`:
    whether rec.sync_step ascends (`sync_in_order`), if the caller knows (a chunked write);
    `cause` False leaves out the string column bubble_cause."""
    hi = rec.num_steps if hi is None else min(hi, rec.num_steps)
    cut = slice(lo, hi)
    cols: dict[str, object] = {"step": np.arange(lo, hi, dtype=np.int64)}
    for j, f in enumerate(SHAPE_FIELDS):
        cols[f] = rec.shape[cut, j]
    for j, p in enumerate(CPU_PHASES):
        cols[f"{p}_start_s"] = rec.phase_start[cut, j]
        cols[f"{p}_end_s"] = rec.phase_end[cut, j]
    cols.update(_sync_columns(rec, lo, hi, sync_sorted))
    cols["gpu_start_s"] = rec.gpu_start[cut]
    cols["gpu_end_s"] = rec.gpu_end[cut]
    gc_in = (rec.gc_step >= lo) & (rec.gc_step < hi)  # in recorded order: the same sums
    gc_row = rec.gc_step[gc_in] - lo
    gc_s = np.bincount(gc_row, weights=rec.gc_dur[gc_in], minlength=hi - lo)
    # as one bincount over the whole run gives it: int64 zeros when no pause has a step
    cols["gc_s"] = gc_s.astype(np.float64 if (rec.gc_step >= 0).any() else np.int64)
    cols["gc_count"] = np.bincount(gc_row, minlength=hi - lo).astype(np.int64)
    cols["gpu_idle_before_s"] = bub.gpu_idle_before_s[cut]
    cols["bubble_before_s"] = bub.bubble_before_s[cut]
    if cause:
        codes = pa.array(bub.bubble_cause_code[cut].astype(np.int32) + 1)
        names = pa.array(("", *CAUSES), pa.string())
        cols["bubble_cause"] = pa.DictionaryArray.from_arrays(codes, names).dictionary_decode()
    cols["accepted_draft_tokens"] = rec.accepted[cut]
    assert tuple(cols) == tuple(c for c in STEP_COLUMNS if cause or c != "bubble_cause")
    return pa.table(cols)


def sync_in_order(rec: Recording) -> bool:
    """Whether the sync waits are recorded in step order (a step loop's are)."""
    step = rec.sync_step
    return bool(np.all(step[1:] >= step[:-1]))


def _sync_columns(rec: Recording, lo: int, hi: int, in_order: bool | None) -> dict[str, np.ndarray]:
    """The sync columns of steps [lo, hi): from their waits alone (a slice when the waits are
    in step order, as a step loop records them; a mask otherwise), in recorded order."""
    step = rec.sync_step
    if step.size and (lo > 0 or hi < rec.num_steps):
        if sync_in_order(rec) if in_order is None else in_order:
            a, b = np.searchsorted(step, [lo, hi])
            pick: slice | np.ndarray = slice(int(a), int(b))
        else:
            pick = np.flatnonzero((step >= lo) & (step < hi))
        s0, s1, step = rec.sync_start[pick], rec.sync_end[pick], step[pick] - lo
    else:
        s0, s1, step = rec.sync_start, rec.sync_end, step - lo
    n = hi - lo
    dur = s1 - s0
    start, end = np.full(n, np.nan), np.full(n, np.nan)
    if dur.size:
        first = _longest_per_step(step, dur)
        start[step[first]] = s0[first]
        end[step[first]] = s1[first]
    return {
        "sync_start_s": start,
        "sync_end_s": end,
        "sync_s": np.bincount(step, weights=dur, minlength=n)[:n].astype(np.float64),
        "sync_count": np.bincount(step, minlength=n)[:n].astype(np.int64),
    }


def gc_table(rec: Recording) -> pa.Table:
    return pa.table(
        {
            "start_s": rec.gc_start,
            "duration_s": rec.gc_dur,
            "generation": rec.gc_gen,
            "phase": pa.array(list(rec.gc_phase), pa.string()),
            "step": rec.gc_step,
        }
    )


def _longest_per_step(step: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Per step with a sync wait, the index of its longest one (ties: the first recorded).
    Waits recorded in step order (a step loop's) take no sort; one wait a step, each its own."""
    if np.all(step[1:] > step[:-1]):
        return np.arange(step.size)
    if np.all(step[1:] >= step[:-1]) and not np.isnan(dur).any():
        group = np.flatnonzero(np.concatenate(([True], step[1:] != step[:-1])))
        longest = np.repeat(np.maximum.reduceat(dur, group), np.diff(np.append(group, dur.size)))
        hit = np.flatnonzero(dur == longest)  # ascending: a group's first hit is its first
        return hit[np.concatenate(([True], step[hit[1:]] != step[hit[:-1]]))]
    order = np.lexsort((-dur, step))  # by step, longest first
    return order[np.concatenate(([True], np.diff(step[order]) != 0))]
