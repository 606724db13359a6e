"""The idle-gap sweep's file (`replay idlegap`, replay.gpu.idlegap) and the idle-start law fitted
from it (`replay calibrate --idle-sweep FILE`).

One row per sample: a decode graph shape timed after the GPU was idle for `idle_ms` (measured),
its step interval `gpu_ms`, and the shape's median interval when queued behind a spin
(`queued_ms`, the pass the profile's decode model is fitted on). The law is the one
replay.analysis.idle_start fits on a run's idle-start steps, here with the queued median as the
predicted pass: saved = min(per_ms x (idle - after_ms)+, max_fraction x pass). A file made with
speculative decoding (`spec.k` > 0 in its metadata) times verify graphs and gives the verify law.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .idle_start import MIN_IDLE_MS, fit_shrink_law
from .rowfile import read_rows, write_rows

FORMAT = "replay.idlegap"
META_KEY = b"replay.idlegap"
COLUMNS = {
    "shape": pa.int64(),
    "label": pa.string(),
    "num_reqs": pa.int64(),
    "draft_tokens": pa.int64(),
    "kv_read_tokens": pa.int64(),
    "bucket": pa.int64(),
    "gap_ms": pa.float64(),  # the host's wait after the GPU went idle
    "idle_ms": pa.float64(),  # measured: idle mark -> the step's start mark
    "gpu_ms": pa.float64(),  # the step's interval after that idle
    "queued_ms": pa.float64(),  # the shape's median interval queued behind a spin
    "queued_samples": pa.int64(),
}
MIN_SAMPLES = 30  # fewer samples past MIN_IDLE_MS than this: no law


class IdleGapFileError(ValueError):
    """An idle-gap file that cannot be read or fitted (the message names the file)."""


def write_idlegap(path: str | Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """The rows as parquet with `meta`, whole or not at all (temp + rename)."""
    return write_rows(path, rows, COLUMNS, META_KEY, meta)


def read_idlegap(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(columns, metadata) of an idle-gap file; IdleGapFileError names what is wrong."""
    table, meta = read_rows(path, COLUMNS, META_KEY, "an idle-gap sweep", IdleGapFileError)
    cols = {c: table.column(c).to_numpy() for c in COLUMNS if c != "label"}
    return cols, meta


def fit_idle_sweep(
    paths: Sequence[str | Path], model: str | None = None
) -> tuple[dict[str, float], dict[str, Any]]:
    """The `gpu_pass.idle_start` keys the files give (decode: shrink_*, verify: verify_shrink_*)
    and a report per law. `model`: the profile's model, which every file must match."""
    groups: dict[str, list[dict[str, np.ndarray]]] = {"decode": [], "verify": []}
    for path in paths:
        cols, meta = read_idlegap(path)
        if model is not None and meta.get("model") != model:
            raise IdleGapFileError(
                f"{path}: an idle-gap sweep of '{meta.get('model')}', the runs are '{model}'"
            )
        verify = bool((meta.get("spec") or {}).get("k", 0))
        groups["verify" if verify else "decode"].append(cols)
    table: dict[str, float] = {}
    report: dict[str, Any] = {}
    for kind, parts in groups.items():
        if not parts:
            continue
        c = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        ok = (c["idle_ms"] >= MIN_IDLE_MS) & np.isfinite(c["gpu_ms"]) & (c["queued_ms"] > 0)
        n = int(ok.sum())
        if n < MIN_SAMPLES:
            report[kind] = {"samples": n, "note": f"{n} samples (< {MIN_SAMPLES}): not fitted"}
            continue
        idle, meas, pred = c["idle_ms"][ok], c["gpu_ms"][ok], c["queued_ms"][ok]
        per, after, frac, err = fit_shrink_law(idle, meas, pred)
        none_err = float(np.median(np.abs(meas - pred)))
        if err >= none_err:  # the samples show no saving the law could follow
            report[kind] = {
                "samples": n,
                "note": f"no saving measured (median |error| {none_err:.3f} ms without a law, "
                f"{err:.3f} ms with the best one): not fitted",
                "saved_ms_by_gap": saved_by_gap(idle, meas, pred),
            }
            continue
        prefix = "verify_" if kind == "verify" else ""
        table.update(
            {
                f"{prefix}shrink_per_ms": per,
                f"{prefix}shrink_after_ms": after,
                f"{prefix}shrink_max_fraction": frac,
            }
        )
        report[kind] = {
            "samples": n,
            "shapes": int(np.unique(c["shape"][ok]).size),
            "shrink_per_ms": per,
            "shrink_after_ms": after,
            "shrink_max_fraction": frac,
            "abs_err_ms_law": err,
            "abs_err_ms_none": none_err,
            "saved_ms_by_gap": saved_by_gap(idle, meas, pred),
        }
    return table, report


GAP_BANDS_MS = (0.05, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)


def saved_by_gap(idle_ms: np.ndarray, meas_ms: np.ndarray, pred_ms: np.ndarray) -> list[Any]:
    """[idle band lo, hi, samples, median saved ms, median saved fraction] per band."""
    out: list[Any] = []
    for lo, hi in zip(GAP_BANDS_MS[:-1], GAP_BANDS_MS[1:]):
        m = (idle_ms >= lo) & (idle_ms < hi)
        if m.any():
            saved = pred_ms[m] - meas_ms[m]
            out.append(
                [lo, hi, int(m.sum()), float(np.median(saved)),
                 float(np.median(saved / pred_ms[m]))]
            )  # fmt: skip
    return out
