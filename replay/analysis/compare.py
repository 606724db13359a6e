"""Fidelity of a predicted run against a measured one (`python -m replay compare`).

Three views, from coarse to fine:
- metrics: every flat summary metric (metrics.py), predicted vs measured, relative error
  (fractions: absolute error in points), read against the measured run's repeat spread;
- requests: joined on request_id, the distribution of per-request e2e/TTFT/TPOT errors;
- steps: matched by index. The policy is shared, so with the same trace and config both runs
  schedule the same batches; `fraction_identical` says how far that held, and the GPU and CPU
  time errors are taken over the identical steps only.
Pass/fail is against the targets of the "Replay on a real GPU" issue (TARGETS).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bubblesim.core.config import flatten
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import Run
from bubblesim.core.runfmt.metrics import flat_metrics, is_fraction, rel_error
from bubblesim.core.runfmt.stats import dist
from bubblesim.core.shape import SHAPE_FIELDS

# metric -> (kind, bound): |relative error| <= bound, or |error| <= bound points
TARGETS: dict[str, tuple[str, float]] = {
    "output_tok_per_s": ("relative", 0.03),
    "tpot_s.p50": ("relative", 0.05),
    "tpot_s.p99": ("relative", 0.10),
    "ttft_s.p50": ("relative", 0.10),
    "bubble_fraction": ("absolute_points", 2.0),
}
# config keys that may differ between a prediction and a measurement of the same experiment
HARDWARE_KEYS = ("device", "gpu", "profile", "arrival", "seed")


class CompareError(ValueError):
    """Two runs that cannot be compared; the message says why."""


def compare_runs(pred: Run, meas: Run, allow_other_trace: bool = False) -> dict[str, Any]:
    """The fidelity record (fidelity.json) of `pred` against `meas`."""
    pt, mt = pred.summary.get("trace", {}), meas.summary.get("trace", {})
    if pt.get("sha256") != mt.get("sha256") and not allow_other_trace:
        raise CompareError(
            f"the runs replay different traces ('{pt.get('path')}' sha256 "
            f"{str(pt.get('sha256'))[:12]} vs '{mt.get('path')}' {str(mt.get('sha256'))[:12]})"
        )
    metrics = metric_table(pred.summary, meas.summary)
    targets = check_targets(metrics)
    return {
        "predicted": _describe(pred),
        "measured": _describe(meas),
        "sides_warning": sides_warning(pred.summary, meas.summary),
        "config_differences": config_differences(pred.summary, meas.summary),
        "notes": caveats(pred.summary, meas.summary),
        "metrics": metrics,
        "targets": targets,
        "passed": all(t["passed"] for t in targets.values()),
        "requests": request_alignment(pred, meas),
        "steps": step_alignment(pred, meas),
    }


def sides_warning(pred: dict[str, Any], meas: dict[str, Any]) -> str | None:
    """Why this is no fidelity check (summary.json `source.kind` of each side), or None when
    a predicted (sim) run is compared with a measured (replay) one."""
    pk = (pred.get("source") or {}).get("kind")
    mk = (meas.get("source") or {}).get("kind")
    if mk == "replay" and pk == "sim":
        return None
    if mk == "replay":
        return "both runs were measured (replay): this compares two measurements"
    if pk == "replay":
        return (
            "the runs look swapped: MEASURED is a sim run and PREDICTED a replay run "
            "(give the sim run first)"
        )
    return (
        "neither run was measured (both are sim runs): this compares two predictions, "
        "it is no fidelity check"
    )


def _describe(run: Run) -> dict[str, Any]:
    s = run.summary
    return {
        "path": str(run.path),
        "source": s.get("source"),
        "complete": bool(s.get("complete")),
        "num_steps": s.get("num_steps"),
        "num_requests": s.get("num_requests"),
    }


# ---- metrics ------------------------------------------------------------------------------------
def metric_table(pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, dict[str, Any]]:
    p, m = flat_metrics(pred), flat_metrics(meas)
    spreads = meas.get("repeat_spread") or {}
    out: dict[str, dict[str, Any]] = {}
    for name in p:
        row: dict[str, Any] = {
            "predicted": p[name],
            "measured": m[name],
            "rel_error": rel_error(p[name], m[name]),
        }
        if is_fraction(name):
            row["error_kind"] = "absolute_points"
            both = p[name] is not None and m[name] is not None
            row["abs_error_points"] = 100 * (p[name] - m[name]) if both else None  # type: ignore[operator]
        else:
            row["error_kind"] = "relative"
        sp = spreads.get(name)
        if sp:
            row["measured_spread"] = sp
            row["within_spread"] = _within_spread(row, sp)
        out[name] = row
    return out


def _within_spread(row: dict[str, Any], sp: dict[str, Any]) -> bool | None:
    """The error is no larger than the measured run-to-run range (max - min over repeats)."""
    if row["error_kind"] == "absolute_points":
        err, bound = row.get("abs_error_points"), sp.get("range_points")
    else:
        err, bound = row.get("rel_error"), sp.get("range_rel")
    if err is None or bound is None:
        return None
    return abs(err) <= bound


def check_targets(metrics: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (kind, bound) in TARGETS.items():
        row = metrics[name]
        err = row["abs_error_points"] if kind == "absolute_points" else row["rel_error"]
        out[name] = {
            "kind": kind,
            "bound": bound,
            "error": err,
            "passed": err is not None and abs(err) <= bound,
        }
    return out


def _kv_blocks(s: dict[str, Any]) -> int | None:
    for path in (("sim", "num_kv_blocks"), ("replay", "engine", "num_kv_blocks")):
        node: Any = s
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, int):
            return node
    return None


def caveats(pred: dict[str, Any], meas: dict[str, Any]) -> list[str]:
    """What makes the two runs differ other than timing, in words for the report."""
    out = []
    for name, s in (("predicted", pred), ("measured", meas)):
        if not s.get("complete"):
            out.append(f"the {name} run is incomplete (interrupted): its metrics cover part of it")
    kp, km = _kv_blocks(pred), _kv_blocks(meas)
    if kp is not None and km is not None and kp != km:
        out.append(
            f"KV cache sizes differ ({kp} predicted vs {km} measured blocks): preemptions and "
            "so schedules may differ; set num_kv_blocks in both for a step-by-step comparison"
        )
    arrivals = {(s.get("config") or {}).get("arrival") for s in (pred, meas)}
    if "asap" in arrivals:
        out.append("arrival=asap: check that both runs queued every request at the start")
    return out


def config_differences(pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, list[Any]]:
    """Flat config keys whose values differ, hardware keys excluded: {key: [pred, meas]}."""
    a, b = flatten(pred.get("config") or {}), flatten(meas.get("config") or {})
    keys = sorted(set(a) | set(b))
    keys = [k for k in keys if a.get(k) != b.get(k) and k not in HARDWARE_KEYS]
    return {k: [a.get(k), b.get(k)] for k in keys}


# ---- requests -----------------------------------------------------------------------------------
def request_alignment(pred: Run, meas: Run) -> dict[str, Any]:
    """Per-request errors over requests present in both runs (joined on request_id)."""
    p, m = pred.arrays("requests"), meas.arrays("requests")
    p_ids = [str(x) for x in p["request_id"].tolist()]
    m_row = {str(x): i for i, x in enumerate(m["request_id"].tolist())}
    pi = np.array([i for i, rid in enumerate(p_ids) if rid in m_row], np.int64)
    mi = np.array([m_row[p_ids[i]] for i in pi.tolist()], np.int64)
    out: dict[str, Any] = {
        "matched": int(pi.size),
        "only_predicted": len(p_ids) - int(pi.size),
        "only_measured": len(m_row) - int(pi.size),
        "output_tokens_equal": bool(np.array_equal(p["output_tokens"][pi], m["output_tokens"][mi])),
    }
    for key in ("e2e_s", "ttft_s", "tpot_s"):
        a, b = p[key][pi].astype(np.float64), m[key][mi].astype(np.float64)
        ok = np.isfinite(a) & np.isfinite(b) & (b > 0)
        rel = (a[ok] - b[ok]) / b[ok]
        out[key] = {
            "n": int(ok.sum()),
            "rel_error": dist(rel),
            "abs_rel_error": dist(np.abs(rel)),
            "error_ms": dist((a[ok] - b[ok]) * 1e3),
        }
    return out


# ---- steps --------------------------------------------------------------------------------------
def step_alignment(pred: Run, meas: Run) -> dict[str, Any]:
    """Steps matched by index: identical batch composition, then time errors on those."""
    p, m = pred.arrays("steps"), meas.arrays("steps")
    n_p, n_m = len(p["step"]), len(m["step"])
    n = min(n_p, n_m)
    same = np.ones(n, bool)
    field_mismatch = {}
    for f in SHAPE_FIELDS:
        if f in pred.filled or f in meas.filled:
            continue  # a run older than the field did not record it (bubblesim.core.runfmt.io)
        eq = p[f][:n] == m[f][:n]
        field_mismatch[f] = int((~eq).sum())
        same &= eq
    diverge = np.flatnonzero(~same)
    out: dict[str, Any] = {
        "predicted_steps": n_p,
        "measured_steps": n_m,
        "same_num_steps": n_p == n_m,
        "identical": int(same.sum()),
        "fraction_identical": float(same.sum() / max(n_p, n_m)) if max(n_p, n_m) else 1.0,
        "first_difference": int(diverge[0]) if diverge.size else (None if n_p == n_m else n),
        "mismatched_steps_by_field": field_mismatch,
    }
    idx = np.flatnonzero(same)
    gp = (p["gpu_end_s"] - p["gpu_start_s"])[:n][idx] * 1e3
    gm = (m["gpu_end_s"] - m["gpu_start_s"])[:n][idx] * 1e3
    decode = p["num_prefill_reqs"][:n][idx] == 0
    out["gpu_ms_error"] = {
        "all": _err(gp, gm),
        "decode": _err(gp[decode], gm[decode]),
        "mixed": _err(gp[~decode], gm[~decode]),
    }
    out["cpu_ms_error"] = {}
    for ph in CPU_PHASES:
        a = (p[f"{ph}_end_s"] - p[f"{ph}_start_s"])[:n][idx] * 1e3
        b = (m[f"{ph}_end_s"] - m[f"{ph}_start_s"])[:n][idx] * 1e3
        out["cpu_ms_error"][ph] = _err(a, b)
    return out


def _err(pred_ms: np.ndarray, meas_ms: np.ndarray) -> dict[str, Any]:
    ok = np.isfinite(pred_ms) & np.isfinite(meas_ms)
    a, b = pred_ms[ok], meas_ms[ok]
    d = a - b
    pos = b > 0
    return {
        "n": int(ok.sum()),
        "error_ms": dist(d),
        "abs_error_ms": dist(np.abs(d)),
        "rel_error": dist(d[pos] / b[pos]),
        "predicted_ms_mean": float(a.mean()) if a.size else None,
        "measured_ms_mean": float(b.mean()) if b.size else None,
    }
