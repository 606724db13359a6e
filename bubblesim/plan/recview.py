"""What the plan reads from bubblesim/core/runfmt beyond a frozen `Recording`:

- Per-request times of a `RunRecorder` during a run (to stop a run once its SLO verdict is
  certain), through its read-only views. The request columns are only viewed once every
  request was added (`add_request` for all rows before the run), so they never need to grow
  while a view exists.
- Its raw inter-token samples after the run (to merge the ITL distributions of replicas).
- Bubble totals without the per-cause attribution (`bubble_totals`): the first half of
  `account_bubbles`, ~10x cheaper on an hour of steps; the plan attributes causes only for
  points at the trace's own load (the ones its report breaks down).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bubblesim.core.runfmt import CAUSES, Bubbles, RunRecorder
from bubblesim.core.runfmt.bubbles import empty_bubbles, gpu_intervals
from bubblesim.core.runfmt.intervals import measure_upto, union
from bubblesim.core.runfmt.recording import Recording
from bubblesim.core.runfmt.sketch import LogHistogram
from bubblesim.core.runfmt.stats import QUANTILES, weighted_quantiles


@dataclass(frozen=True)
class RequestColumns:
    """Read-only zero-copy views, one row per request added to the recorder (NaN = not yet)."""

    arrival: np.ndarray
    first_token: np.ndarray
    last_token: np.ndarray
    finish: np.ndarray
    output_tokens: np.ndarray


def request_columns(rec: RunRecorder) -> RequestColumns:
    return RequestColumns(
        arrival=rec.arrival_s,
        first_token=rec.first_token_s,
        last_token=rec.last_token_s,
        finish=rec.finish_s,
        output_tokens=rec.output_tokens,
    )


def merged_itl_quantiles(recs: list[RunRecorder]) -> dict[str, float | None]:
    """ITL quantiles over every token of every recorder, as `RunRecorder.freeze` computes them
    for one: exact while no recorder folded its samples into a histogram, else all folded into
    one `LogHistogram` (relative error 0.1 %). Call after `freeze()`."""
    qs = list(QUANTILES.values())
    if all(r.itl_histogram is None for r in recs):
        samples = [r.itl_samples for r in recs]
        v = np.concatenate([s[0] for s in samples])
        w = np.concatenate([s[1] for s in samples])
        x = weighted_quantiles(v, w, qs)
    else:
        hist = LogHistogram()
        for r in recs:
            folded = r.itl_histogram
            if folded is not None:
                hist.merge(folded)
            hist.add(*r.itl_samples)
        x = hist.quantiles(qs)
    return {k: (None if np.isnan(v) else float(v)) for k, v in zip(QUANTILES, x)}


def bubble_totals(rec: Recording, overlap_tol_s: float = 1e-6) -> Bubbles:
    """`account_bubbles(rec)` with the same window, busy, bubble and idle seconds, but
    `by_cause` all zero and no per-step or per-piece arrays."""
    _, s, e = gpu_intervals(rec, overlap_tol_s)
    finite = [t[np.isfinite(t)] for t in (rec.arrival, s, e, rec.finish, rec.last_token)]
    if not any(t.size for t in finite):
        return empty_bubbles(0)
    start_s = float(min(t.min() for t in finite if t.size))
    end_s = float(max(t.max() for t in finite if t.size))
    ds, de = union(rec.arrival, np.where(np.isnan(rec.finish), end_s, rec.finish))
    gap_s = np.concatenate(([start_s], e))
    gap_e = np.maximum(np.concatenate((s, [end_s])), gap_s)
    bubble_s = float(np.sum(measure_upto(ds, de, gap_e) - measure_upto(ds, de, gap_s)))
    none = np.zeros(0)
    return Bubbles(
        start_s=start_s,
        end_s=end_s,
        busy_s=float(np.sum(e - s)),
        bubble_s=bubble_s,
        idle_s=float(np.sum(gap_e - gap_s)) - bubble_s,
        by_cause=dict.fromkeys(CAUSES, 0.0),
        gpu_idle_before_s=none,
        bubble_before_s=none,
        bubble_cause_code=np.zeros(0, dtype=np.int8),
        piece_start=none,
        piece_end=none,
        piece_cause=np.zeros(0, np.int64),
    )
