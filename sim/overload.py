"""Is a run overloaded: did requests arrive faster than the engine completed them?

An overloaded run's latencies measure the queue, not the engine (the bundled Mooncake trace on
the default engine: 3.9 req/s offered, 1.56 completed, TTFT p99 25 minutes), so the run says so.

Definitions (all from the run's own requests; times in seconds since the trace start):
- offered_req_per_s   = (n - 1) / (last arrival - first arrival): the trace's mean arrival
  rate (n - 1 inter-arrival gaps over the arrival span); None when all arrive at once.
- sustained_req_per_s = finished requests / (last finish - first arrival): the rate the engine
  completed requests over the run's busy span (summary.json's `req_per_s`); under overload it
  is the rate this engine sustains on this mix of requests.
- queued_at_last_arrival = requests that arrived before the last arrival but had no first
  token by then: the backlog when the offered load stops. A stable engine keeps it near its
  admission queue; an overloaded one grows it by (offered - sustained) per second.
The run is overloaded when sustained < SUSTAINED_BELOW x offered AND the backlog holds at least
BACKLOG_FRACTION of the trace's requests and at least MIN_BACKLOG requests. The backlog test
keeps a short trace whose last requests take long to drain (its busy span much longer than its
arrival span, so `sustained` is low) from being called overloaded while nothing ever queued.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SUSTAINED_BELOW = 0.9
BACKLOG_FRACTION = 0.1
MIN_BACKLOG = 5  # a few requests in the admission queue are normal on a small trace
RULE = (
    f"sustained_req_per_s < {SUSTAINED_BELOW} x offered_req_per_s and queued_at_last_arrival "
    f">= max({BACKLOG_FRACTION} x requests, {MIN_BACKLOG})"
)


def overload_of(
    arrival_s: np.ndarray, first_token_s: np.ndarray, finish_s: np.ndarray
) -> dict[str, Any]:
    """summary.json's `overload` (see the module docstring); NaN = never happened."""
    n = arrival_s.size
    out: dict[str, Any] = {
        "overloaded": False,
        "offered_req_per_s": None,
        "sustained_req_per_s": None,
        "queued_at_last_arrival": 0,
        "rule": RULE,
    }
    if n < 2:
        return out
    first, last = float(arrival_s.min()), float(arrival_s.max())
    done = np.isfinite(finish_s)
    if done.any():
        busy_s = float(finish_s[done].max()) - first
        out["sustained_req_per_s"] = int(done.sum()) / busy_s if busy_s > 0 else None
    if last <= first:
        return out  # a burst at one instant: no arrival rate to compare with
    offered = (n - 1) / (last - first)
    out["offered_req_per_s"] = offered
    # arrived before the last arrival, no first token by then (NaN: never got one: queued too)
    queued = int(np.sum((arrival_s < last) & ~(first_token_s <= last)))
    out["queued_at_last_arrival"] = queued
    sustained = out["sustained_req_per_s"] or 0.0
    backlog = queued >= max(BACKLOG_FRACTION * n, MIN_BACKLOG)
    out["overloaded"] = sustained < SUSTAINED_BELOW * offered and backlog
    return out


def overload_line(summary: dict[str, Any]) -> str | None:
    """The one-line notice for an overloaded run (None when it is not)."""
    ov = summary.get("overload") or {}
    if not ov.get("overloaded"):
        return None
    ttft = (summary.get("ttft_s") or {}).get("p99")
    ttft_text = f"; TTFT p99 {_duration(ttft)} is mostly queueing" if ttft else ""
    return (
        f"overloaded: {ov['offered_req_per_s']:.3g} req/s offered, {ov['sustained_req_per_s']:.3g}"
        f" req/s sustained (completed over the busy span); {ov['queued_at_last_arrival']:,} "
        f"requests still queued at the last arrival{ttft_text}"
    )


def _duration(s: float) -> str:
    return f"{s:.3g} s" if s < 120 else f"{s / 60:.3g} min"
