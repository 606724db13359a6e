"""A window of a trace: the requests that arrive in [from_s, to_s), moved to start at 0 and
optionally replayed faster, for runs of tens of seconds (a replay runs in real time).

    arrival_s' = (arrival_s - from_s) / speedup     for from_s <= arrival_s < to_s

so every inter-arrival time is divided by `speedup` and the window's start is t = 0 (its first
request arrives at (first arrival - from_s) / speedup, the gap it had after from_s). Requests
whose prompt is longer than `max_prompt_len` are dropped (and counted), not refused: a window of
a public trace routinely holds a few prompts beyond a small model's context. Rows keep their file
order and every column; the metadata keeps the source's keys, gets a description of the window
and a `cut` key (JSON) that says what was cut, from which trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from bubblesim.core.trace import Trace, TraceError


@dataclass(frozen=True)
class Cut:
    """What `cut_trace` kept and dropped."""

    trace: Trace
    in_window: int  # requests arriving in [from_s, to_s)
    dropped_long_prompt: int  # of those, dropped for prompt_len > max_prompt_len


def cut_trace(
    trace: Trace,
    from_s: float,
    to_s: float,
    speedup: float = 1.0,
    max_prompt_len: int | None = None,
    source: str | None = None,
) -> Cut:
    """The window [from_s, to_s) of `trace` (see the module docstring); `source` names the
    trace it came from in the metadata. TraceError when the window keeps no request."""
    if not (0 <= from_s < to_s) or not np.isfinite(to_s):
        raise TraceError(f"window [{from_s:g}, {to_s:g}) s: need 0 <= from < to < inf")
    if not (speedup > 0 and np.isfinite(speedup)):
        raise TraceError(f"speedup {speedup:g}: must be a finite number > 0")
    if max_prompt_len is not None and max_prompt_len < 1:
        raise TraceError(f"max prompt length {max_prompt_len}: must be >= 1")
    inside = (trace.arrival_s >= from_s) & (trace.arrival_s < to_s)
    in_window = int(inside.sum())
    keep = inside
    if max_prompt_len is not None:
        keep = inside & (trace.prompt_len <= max_prompt_len)
    dropped = in_window - int(keep.sum())
    if not keep.any():
        why = f"; all {in_window} over {max_prompt_len} prompt tokens" if in_window else ""
        raise TraceError(f"window [{from_s:g}, {to_s:g}) s holds no request{why}")
    w = trace.take(np.flatnonzero(keep))
    arrival = w.arrival_s - from_s if from_s else w.arrival_s
    arrival = arrival / speedup
    cut: dict[str, Any] = {
        "source": source,
        "from_s": from_s,
        "to_s": to_s,
        "speedup": speedup,
        "max_prompt_len": max_prompt_len,
        "in_window": in_window,
        "dropped_long_prompt": dropped,
    }
    desc = trace.metadata.get("description", "a bundled trace")
    span = f"first {to_s:g} s" if from_s == 0 else f"{from_s:g}-{to_s:g} s"
    meta = {
        **trace.metadata,
        "description": f"{span} of {desc} at {speedup:g}x",
        "cut": json.dumps(cut),
    }
    return Cut(replace(w, arrival_s=arrival, metadata=meta), in_window, dropped)
