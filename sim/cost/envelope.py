"""The operating envelope of a fitted GPU pass model: which batch shapes its fit measured.

A profile's `envelope` (written by `replay calibrate`) holds, per batch kind, the range
[lo, hi] of each of ENVELOPE_FIELDS over the rows the kind's GPU model was fitted on:

  "envelope": {"decode": {"num_reqs": [1, 256], "num_tokens": [1, 256],
                          "kv_per_req": [128, 16384], "max_kv_tokens": [128, 38000]},
               "mixed": {..., "prefill_tokens": [16, 8192]}}

A step lies outside when any recorded field is outside its range (a box: a corner of the box
the sweep never reached, e.g. 256 rows of 16k context, counts as inside). `outside_share`
computes, after a run, the share of each kind's steps and of their GPU time outside
(`python -m sim run` writes it as summary key `cost_envelope`): a prediction is an
extrapolation for those steps. Vectorized over the recorded step columns, never per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

ENVELOPE_KINDS = ("decode", "mixed", "verify")
ENVELOPE_FIELDS = ("num_reqs", "num_tokens", "kv_per_req", "max_kv_tokens", "prefill_tokens")
Cols = Mapping[str, np.ndarray]


class EnvelopeError(ValueError):
    def __init__(self, key: str, why: str) -> None:
        super().__init__(why)
        self.key = key
        self.why = why


def check_envelope(env: Any) -> None:
    """Raise EnvelopeError naming the bad key (relative to `envelope`)."""
    if not isinstance(env, dict):
        raise EnvelopeError("", f"expected an object, got {env!r}")
    for kind, ranges in env.items():
        if kind not in ENVELOPE_KINDS:
            raise EnvelopeError(kind, f"unknown key, expected one of {list(ENVELOPE_KINDS)}")
        if not isinstance(ranges, dict):
            raise EnvelopeError(kind, f"expected an object, got {ranges!r}")
        for name, r in ranges.items():
            key = f"{kind}.{name}"
            if name not in ENVELOPE_FIELDS:
                raise EnvelopeError(key, f"unknown key, expected one of {list(ENVELOPE_FIELDS)}")
            ok = isinstance(r, list) and len(r) == 2
            ok = ok and all(
                not isinstance(v, bool) and isinstance(v, int | float) and np.isfinite(v) for v in r
            )
            if not ok or r[0] > r[1]:
                raise EnvelopeError(key, f"expected [lo, hi] with lo <= hi, got {r!r}")


def field_values(name: str, cols: Cols) -> np.ndarray:
    """An envelope field on columns holding the shape fields and num_tokens."""
    if name == "kv_per_req":
        return cols["kv_read_tokens"] / np.maximum(cols["num_reqs"], 1)
    if name == "num_tokens" and "num_tokens" not in cols:
        return cols["prefill_tokens"] + cols["decode_tokens"]
    return np.asarray(cols[name], np.float64)


def kind_masks(cols: Cols, verify: bool) -> dict[str, np.ndarray]:
    """Pure decode (no prefill request, at least one request), mixed steps and, with `verify`
    (the profile models spec verify steps apart), decode steps with drafts taken from decode."""
    decode = (cols["num_prefill_reqs"] == 0) & (cols["num_reqs"] > 0)
    drafts = decode & (cols["draft_tokens"] > 0) if verify else np.zeros(len(decode), bool)
    return {"decode": decode & ~drafts, "mixed": cols["num_prefill_reqs"] > 0, "verify": drafts}


def ranges_of(cols: Cols, rows: np.ndarray, fields: tuple[str, ...] = ENVELOPE_FIELDS):
    """[lo, hi] of each field over the selected rows (the fit's rows): one kind's envelope."""
    out: dict[str, list[float]] = {}
    for f in fields:
        v = field_values(f, cols)[rows]
        if v.size:
            out[f] = [float(v.min()), float(v.max())]
    return out


def outside(ranges: Mapping[str, list[float]], cols: Cols) -> np.ndarray:
    """Bool per row: some field outside its [lo, hi]."""
    n = len(next(iter(cols.values())))
    out = np.zeros(n, bool)
    for f, (lo, hi) in ranges.items():
        v = field_values(f, cols)
        out |= (v < lo) | (v > hi)
    return out


def outside_share(envelope: Mapping[str, Any], cols: Cols, gpu_ms: np.ndarray) -> dict[str, Any]:
    """Per kind the envelope covers: steps, the share of them outside it and the share of their
    GPU time outside it (0 when the kind has no step)."""
    out: dict[str, Any] = {}
    masks = kind_masks(cols, "verify" in envelope)
    for kind, ranges in envelope.items():
        mine = masks[kind]
        off = outside(ranges, cols) & mine
        n = int(mine.sum())
        total = float(gpu_ms[mine].sum())
        out[kind] = {
            "steps": n,
            "steps_outside": int(off.sum()) / n if n else 0.0,
            "gpu_time_outside": float(gpu_ms[off].sum()) / total if total > 0 else 0.0,
        }
    return out


def describe(share: Mapping[str, Any]) -> str | None:
    """One line for the run's printout, or None when every step was inside."""
    parts = [
        f"{100 * v['steps_outside']:.1f} % of {k} steps ({100 * v['gpu_time_outside']:.1f} % "
        f"of their GPU time)"
        for k, v in share.items()
        if v["steps_outside"] > 0
    ]
    if not parts:
        return None
    return (
        "cost model: "
        + " and ".join(parts)
        + " fall outside the profile's measured envelope (extrapolated; summary cost_envelope)"
    )
