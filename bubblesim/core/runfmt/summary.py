"""summary.json of a run (Contract 3): headline metrics, where GPU time went, provenance.

Rates use the span (first arrival to last finish, see bubbles.py): output_tok_per_s counts
every output token, req_per_s finished requests. Latency distributions use stats.dist (the
linear percentile definition) over requests that have the value; itl_s is per token
(records.py), exact up to `itl_exact_limit` emissions and within 0.1 % beyond.
gpu_busy_fraction = busy / span; bubble_fraction = bubble / (busy + bubble).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt.bubbles import Bubbles
from bubblesim.core.runfmt.recording import Recording
from bubblesim.core.runfmt.spill import release
from bubblesim.core.runfmt.stats import PERCENTILE_METHOD, dist
from bubblesim.core.runfmt.tables import tpot_s
from bubblesim.core.shape import SHAPE_FIELDS

FORMAT = "bubblesim-run"
# 2: parquet files in bubblesim.core.runfmt.codec's encoding, `step_records`; version 1 folders
# still load
FORMAT_VERSION = 2
READ_VERSIONS: tuple[int, ...] = (1, 2)
REQUIRED_KEYS: tuple[str, ...] = (
    "format",
    "format_version",
    "complete",
    "config",
    "trace",
    "source",
    "output_tok_per_s",
    "req_per_s",
    "ttft_s",
    "tpot_s",
    "itl_s",
    "e2e_s",
    "gpu_busy_fraction",
    "bubble_fraction",
    "bubble_s_by_cause",
)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _mean_ms(durations_s: np.ndarray) -> float | None:
    finite = np.isfinite(durations_s)
    d = durations_s if finite.all() else durations_s[finite]  # the same values, not copied
    return float(d.mean() * 1e3) if d.size else None


def build_summary(
    rec: Recording,
    bub: Bubbles,
    *,
    config: dict[str, Any],
    trace: dict[str, Any],
    source: dict[str, Any],
    complete: bool,
    timeline: dict[str, Any] | None,
    extra: dict[str, Any] | None = None,
    step_records: bool = True,
) -> dict[str, Any]:
    span = bub.span_s
    finished = np.isfinite(rec.finish)
    itl_count = int(np.maximum(rec.output_tokens - 1, 0).sum())
    itl_sum = float(np.nansum(np.where(rec.output_tokens > 1, rec.last_token - rec.first_token, 0)))
    itl = dict(rec.itl_quantiles)
    itl["mean"] = itl_sum / itl_count if itl_count else None
    out: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "complete": bool(complete),
        "source": source,
        "config": config,
        "trace": trace,
        "num_requests": rec.num_requests,
        "num_finished": int(finished.sum()),
        "num_steps": rec.num_steps,
        "output_tokens": int(rec.output_tokens.sum()),
        "start_s": bub.start_s,
        "end_s": bub.end_s,
        "span_s": span,
        "output_tok_per_s": _ratio(float(rec.output_tokens.sum()), span),
        "req_per_s": _ratio(float(finished.sum()), span),
        "ttft_s": dist(rec.first_token - rec.arrival),
        "tpot_s": dist(tpot_s(rec)),
        "itl_s": itl,
        "itl_exact": rec.itl_exact,
        "itl_count": itl_count,
        "e2e_s": dist(rec.finish - rec.arrival),
        "percentile_method": PERCENTILE_METHOD,
        "gpu_busy_s": bub.busy_s,
        "bubble_s": bub.bubble_s,
        "idle_s": bub.idle_s,
        "gpu_busy_fraction": _ratio(bub.busy_s, span),
        "bubble_fraction": bub.bubble_fraction,
        "bubble_s_by_cause": bub.by_cause,
        "gpu_ms_mean": _mean_ms(_released(rec.gpu_end - rec.gpu_start, rec.gpu_start, rec.gpu_end)),
        "cpu_ms_mean": _cpu_ms(rec),
        "gc": _gc_totals(rec),
        "accepted_draft_tokens": int(rec.accepted.sum()),
        "draft_tokens": int(rec.shape[:, SHAPE_FIELDS.index("draft_tokens")].sum())
        if rec.num_steps
        else 0,
        "timeline": timeline,
        "step_records": step_records,  # false: no steps.parquet or timeline.json (--no-steps)
    }
    release(rec.gpu_start, rec.gpu_end, rec.accepted, rec.shape, rec.sync_start, rec.sync_end)
    for key, value in (extra or {}).items():
        if key in out:
            raise ValueError(f"summary extra key {key!r} clashes with a standard summary key")
        out[key] = value
    return out


def _released(value: np.ndarray, *maps: np.ndarray) -> np.ndarray:
    """`value`, once the spilled maps it was computed from are released."""
    release(*maps)
    return value


def _cpu_ms(rec: Recording) -> dict[str, float | None]:
    """Mean ms of each CPU phase over the steps that ran it; sync: per step that waited."""
    out = {}
    for j, p in enumerate(CPU_PHASES):
        d = _released(rec.phase_end[:, j] - rec.phase_start[:, j], rec.phase_start, rec.phase_end)
        out[p] = _mean_ms(d)  # a spilled run's maps: one phase at a time
    if rec.sync_step.size:  # one temporary at a time, spilled maps released (a long run)
        waited = np.bincount(rec.sync_step) > 0
        dur = rec.sync_end - rec.sync_start
        release(rec.sync_start, rec.sync_end)
        per_step = np.bincount(rec.sync_step, weights=dur)
        release(rec.sync_step)
        del dur
        waits = per_step if waited.all() else per_step[waited]  # a step loop's: every step
        out["sync"] = float(waits.mean() * 1e3)
    else:
        out["sync"] = None
    return out


def _gc_totals(rec: Recording) -> dict[str, Any]:
    by_gen = {
        str(int(g)): {
            "count": int((rec.gc_gen == g).sum()),
            "total_s": float(rec.gc_dur[rec.gc_gen == g].sum()),
        }
        for g in np.unique(rec.gc_gen)
    }
    return {
        "count": int(rec.gc_dur.size),
        "total_s": float(rec.gc_dur.sum()),
        "max_s": float(rec.gc_dur.max()) if rec.gc_dur.size else 0.0,
        "by_generation": by_gen,
    }
