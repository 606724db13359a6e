"""Read-only views of a `RunRecorder`'s per-request columns and ITL samples while it records.

The plan needs two things `RunRecorder` has no public call for: the per-request times during
a run (to stop a run once its SLO verdict is certain) and the raw inter-token samples after it
(to merge the ITL distributions of several replicas). This module is the one place that reads
its private columns; a change in core/runfmt/records.py breaks here (and its tests), nowhere
else. The request columns are only viewed once every request was added (`add_request` for all
rows before the run), so they never resize while a view exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.runfmt import RunRecorder
from core.runfmt.sketch import LogHistogram
from core.runfmt.stats import QUANTILES, weighted_quantiles


@dataclass(frozen=True)
class RequestColumns:
    """Zero-copy views, one row per request added to the recorder (NaN = not yet)."""

    arrival: np.ndarray
    first_token: np.ndarray
    last_token: np.ndarray
    finish: np.ndarray
    output_tokens: np.ndarray


def request_columns(rec: RunRecorder) -> RequestColumns:
    def f64(a: object) -> np.ndarray:
        return np.frombuffer(a, dtype=np.float64)  # type: ignore[call-overload]

    return RequestColumns(
        arrival=f64(rec._arrival),
        first_token=f64(rec._first),
        last_token=f64(rec._last),
        finish=f64(rec._finish),
        output_tokens=np.frombuffer(rec._out, dtype=np.int64),
    )


def merged_itl_quantiles(recs: list[RunRecorder]) -> dict[str, float | None]:
    """ITL quantiles over every token of every recorder, as `RunRecorder.freeze` computes them
    for one: exact while no recorder folded its samples into a histogram, else all folded into
    one `LogHistogram` (relative error 0.1 %). Call after `freeze()`."""
    qs = list(QUANTILES.values())
    if all(r._itl_hist is None for r in recs):
        v = np.concatenate([np.asarray(r._itl_v, np.float64) for r in recs])
        w = np.concatenate([np.asarray(r._itl_w, np.int64) for r in recs])
        x = weighted_quantiles(v, w, qs)
    else:
        hist = LogHistogram()
        for r in recs:
            if r._itl_hist is not None:
                hist._counts += r._itl_hist._counts
            hist.add(np.asarray(r._itl_v, np.float64), np.asarray(r._itl_w, np.int64))
        x = hist.quantiles(qs)
    return {k: (None if np.isnan(v) else float(v)) for k, v in zip(QUANTILES, x)}
