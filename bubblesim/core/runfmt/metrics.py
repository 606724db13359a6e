"""The flat metric names that `replay run --repeat` and `sim run --seeds` spread and `replay
compare` compares.

A run's summary.json nests its metrics (`ttft_s.p50`, `cpu_ms_mean.schedule`); both commands
read the same flat view, so a fidelity row and the run-to-run spread it is read against always
name the same number. Fractions (`bubble_fraction`, `gpu_busy_fraction`) are compared in
absolute points, everything else relatively.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from bubblesim.core.phases import CPU_PHASES, SYNC

DIST_METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
DIST_KEYS = ("p50", "p90", "p99", "mean")
RATE_METRICS = ("output_tok_per_s", "req_per_s")
FRACTION_METRICS = ("bubble_fraction", "gpu_busy_fraction")  # compared in absolute points
CPU_KEYS = (*CPU_PHASES, SYNC)


def flat_metrics(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """Every comparable number of a run summary under its flat name (None where absent)."""
    out: dict[str, float | None] = {}
    for key in RATE_METRICS:
        out[key] = _num(summary.get(key))
    for key in DIST_METRICS:
        d = summary.get(key) or {}
        for q in DIST_KEYS:
            out[f"{key}.{q}"] = _num(d.get(q))
    for key in FRACTION_METRICS:
        out[key] = _num(summary.get(key))
    out["gpu_ms_mean"] = _num(summary.get("gpu_ms_mean"))
    cpu = summary.get("cpu_ms_mean") or {}
    for phase in CPU_KEYS:
        out[f"cpu_ms_mean.{phase}"] = _num(cpu.get(phase))
    gc = summary.get("gc") or {}
    out["gc.total_s"] = _num(gc.get("total_s"))
    out["gc.count"] = _num(gc.get("count"))
    return out


def is_fraction(name: str) -> bool:
    return name in FRACTION_METRICS


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; 0 when both are 0, None when undefined."""
    if predicted is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return (predicted - measured) / abs(measured)


def spread(values: list[float | None]) -> dict[str, float | None]:
    """Run-to-run spread of one metric over repeats: min, max, mean, and the stdev and the
    max-min range relative to the mean (for fractions: `*_points`, absolute, in points)."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"n": 0, **dict.fromkeys(("min", "max", "mean", "stdev_rel", "range_rel"))}
    mean = sum(v) / len(v)
    var = sum((x - mean) ** 2 for x in v) / (len(v) - 1) if len(v) > 1 else 0.0
    sd = math.sqrt(var)
    out: dict[str, float | None] = {"n": len(v), "min": min(v), "max": max(v), "mean": mean}
    out["stdev_rel"] = sd / abs(mean) if mean else (0.0 if sd == 0 else None)
    out["range_rel"] = (max(v) - min(v)) / abs(mean) if mean else (0.0 if sd == 0 else None)
    out["stdev_points"] = 100 * sd
    out["range_points"] = 100 * (max(v) - min(v))
    return out


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None
