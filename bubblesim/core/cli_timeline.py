"""`--timeline-from-s` and `--timeline-steps`: which steps a run's timeline.json holds (shared by
`sim run` and `replay run`, which both write it through bubblesim.core.runfmt.write_run)."""

from __future__ import annotations

import argparse
from typing import Any

from bubblesim.core.runfmt.timeline import DEFAULT_MAX_STEPS


def timeline_steps(text: str) -> int | None:
    """`N` (>= 1) or `all` (None)."""
    if text.strip().lower() == "all":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step count or 'all', got '{text}'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or 'all'), got {n}")
    return n


def seconds_from(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got '{text}'") from None
    if not s >= 0 or s == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return s


def add_timeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeline-from-s",
        type=seconds_from,
        default=0.0,
        metavar="SECONDS",
        help="timeline.json starts at the first step at or after this time in the run "
        "(seconds since the trace start; default 0)",
    )
    p.add_argument(
        "--timeline-steps",
        type=timeline_steps,
        default=DEFAULT_MAX_STEPS,
        metavar="N|all",
        help=f"steps in timeline.json (default {DEFAULT_MAX_STEPS:,}, about 7 MB, which "
        "Perfetto opens at once; 'all' for every step)",
    )


def timeline_line(window: dict[str, Any]) -> str | None:
    """The summary line for a timeline that holds only part of the run (None for all of it)."""
    total = window.get("steps_total", 0)
    if not window.get("truncated") or not total:
        return None
    n = window.get("steps_exported", 0)
    if not n:
        from_s = window.get("from_s", 0.0)
        return f"timeline: empty, no step starts at or after {from_s:g} s ({total:,} steps)"
    first, last = window["first_step"], window["last_step"]
    return (
        f"timeline: steps {first:,}-{last:,} of {total:,}; "
        "--timeline-steps all for every step, --timeline-from-s S for a later window"
    )
