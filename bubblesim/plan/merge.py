"""One fleet summary from the recorders of its replicas.

Every replica's recorder holds a row for every request of the trace (row = arrival rank); a
request has values only in the recorder of the replica it was routed to (`owner`). Latency
distributions are over all requests of the fleet, with the definitions of bubblesim/core/runfmt
(summary.py): TTFT, TPOT (mean gap after the first token), E2E per request, ITL per token.
The fleet span runs from the first arrival (or GPU start) to the last finish (or GPU end) of
any replica; rates are over it. Each replica's bubbles are accounted over its own requests and
window (bubblesim/core/runfmt/bubbles.py); GPU time the fleet pays for outside a replica's window
is idle.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from bubblesim.core.runfmt import RunRecorder, account_bubbles
from bubblesim.core.runfmt.recording import Recording
from bubblesim.core.runfmt.stats import dist
from bubblesim.plan.recview import bubble_totals, merged_itl_quantiles

# Attributing bubbles to causes costs ~10x their totals (~1 s on an hour of steps): only
# worth it where there is something to show.
CAUSES_MIN_FRACTION = 1e-3
UNATTRIBUTED = "unattributed"
_REQUEST_FIELDS = (
    "arrival",
    "first_token",
    "last_token",
    "finish",
    "output_tokens",
    "preemptions",
    "req_accepted",
)


def _rows(rec: Recording, rows: np.ndarray) -> Recording:
    """The recording restricted to the given request rows (its steps unchanged)."""
    cut = {f: getattr(rec, f)[rows] for f in _REQUEST_FIELDS}
    ids = [rec.request_id[i] for i in rows.tolist()]
    return dataclasses.replace(rec, request_id=ids, **cut)


def _pick(frozen: list[Recording], owner: np.ndarray, name: str, fill: float) -> np.ndarray:
    first = getattr(frozen[0], name)
    out = np.full(first.shape, fill, dtype=first.dtype)
    for r, rec in enumerate(frozen):
        rows = owner == r
        out[rows] = getattr(rec, name)[rows]
    return out


def _replica_entry(rec: Recording, rows: np.ndarray, causes: bool) -> dict[str, Any]:
    mine = _rows(rec, rows)
    bub = bubble_totals(mine)
    busy_plus_bubble = bub.busy_s + bub.bubble_s
    by_cause = None
    if causes and bub.bubble_s > CAUSES_MIN_FRACTION * busy_plus_bubble:
        by_cause = account_bubbles(mine, pieces_until_s=-math.inf).by_cause  # no timeline
    return {
        "requests": int(rows.size),
        "output_tokens": int(mine.output_tokens.sum()),
        "preemptions": int(mine.preemptions.sum()),
        "steps": rec.num_steps,
        "span_s": bub.span_s,
        "busy_s": bub.busy_s,
        "bubble_s": bub.bubble_s,
        "idle_s": bub.idle_s,
        "bubble_fraction": bub.bubble_s / busy_plus_bubble if busy_plus_bubble > 0 else 0.0,
        "bubble_s_by_cause": by_cause,
        "_window": (bub.start_s, bub.end_s),
    }


def fleet_summary(
    recorders: list[RunRecorder], owner: np.ndarray, causes: bool = True
) -> dict[str, Any]:
    """`owner[row]` = the replica request `row` went to, -1 if it never arrived (a stopped
    run). With `causes`, the bubbles of replicas whose bubble fraction is at least
    CAUSES_MIN_FRACTION are attributed (`bubble_s_by_cause`; the other replicas' bubbles go to
    "unattributed"); without, or when no replica reaches it, `bubble_s_by_cause` is None."""
    frozen = [r.freeze() for r in recorders]
    arrival = frozen[0].arrival
    first = _pick(frozen, owner, "first_token", math.nan)
    last = _pick(frozen, owner, "last_token", math.nan)
    finish = _pick(frozen, owner, "finish", math.nan)
    out = _pick(frozen, owner, "output_tokens", 0)
    gaps = out - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(gaps > 0, (last - first) / np.maximum(gaps, 1), np.nan)
    # one replica: its recording's quantiles are the merged ones (computed the same way)
    itl = dict(frozen[0].itl_quantiles if len(frozen) == 1 else merged_itl_quantiles(recorders))
    itl_count = int(np.maximum(gaps, 0).sum())
    itl["mean"] = (
        float(np.nansum(np.where(gaps > 0, last - first, 0))) / itl_count if itl_count else None
    )

    replicas = [
        _replica_entry(rec, np.flatnonzero(owner == r), causes) for r, rec in enumerate(frozen)
    ]
    windows = [e.pop("_window") for e in replicas if e["requests"]]
    start_s = min((w[0] for w in windows), default=0.0)
    end_s = max((w[1] for w in windows), default=0.0)
    span = end_s - start_s
    for e in replicas:  # GPU time paid for outside the replica's own window is idle
        e.pop("_window", None)
        e["idle_s"] += max(0.0, span - e["span_s"])
        e["gpu_busy_fraction"] = e["busy_s"] / span if span > 0 else None
    finished = int(np.isfinite(finish).sum())
    busy = sum(e["busy_s"] for e in replicas)
    bubble = sum(e["bubble_s"] for e in replicas)
    by_cause: dict[str, float] | None = None
    if any(e["bubble_s_by_cause"] for e in replicas):
        by_cause = {UNATTRIBUTED: 0.0}
        for e in replicas:
            if e["bubble_s_by_cause"] is None:
                by_cause[UNATTRIBUTED] += e["bubble_s"]
                continue
            for c, s in e["bubble_s_by_cause"].items():
                by_cause[c] = by_cause.get(c, 0.0) + s
    return {
        "num_requests": int(owner.size),
        "num_routed": int(np.count_nonzero(owner >= 0)),
        "num_finished": finished,
        "output_tokens": int(out.sum()),
        "start_s": start_s,
        "end_s": end_s,
        "span_s": span,
        "output_tok_per_s": float(out.sum()) / span if span > 0 else None,
        "req_per_s": finished / span if span > 0 else None,
        "ttft_s": dist(first - arrival),
        "tpot_s": dist(tpot),
        "itl_s": itl,
        "e2e_s": dist(finish - arrival),
        "gpu_s": span * len(replicas),
        "busy_s": busy,
        "bubble_s": bubble,
        "idle_s": span * len(replicas) - busy - bubble,
        "bubble_fraction": bubble / (busy + bubble) if busy + bubble > 0 else 0.0,
        "bubble_s_by_cause": by_cause,
        "replicas": replicas,
    }
