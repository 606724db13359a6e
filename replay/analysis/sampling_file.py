"""The sampling sweep's file (`replay sampling`, replay.gpu.sampling) and the profile's
`sampling` table fitted from it (`replay calibrate --sampling-sweep FILE`, sim.cost.sampling).

One row per (mode, path, what, rows): `path` is `sample` (plain decoding's sampler) or `choose`
(speculative verification's), `what` is `gpu_ms` (captured in a graph) or `host_ms` (the eager
call), `ms` the median over the sweep's repeats. The table holds, per random mode and row
count, that mode's ms less greedy's on the same path: `gpu_ms` (sample) and `spec_gpu_ms`
(choose) per row count as measured; `host_ms` and `spec_host_ms` the median over the row counts
at every row count: a call issues the same launches at every size, and one point is noisy (two
H200 sweeps of the same kernels, 2026-11-27: GPU differences within 0.003 ms at every point,
host differences 0.40-0.89 ms scattered over the sizes).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from replay.analysis.rowfile import read_rows, write_rows
from sim.cost.sampling import GREEDY, MODES, SAMPLING_KEY

META_KEY = b"replay.sampling"
COLUMNS = {
    "mode": pa.string(),
    "path": pa.string(),  # "sample" | "choose"
    "what": pa.string(),  # "gpu_ms" | "host_ms" | "host_hot_ms" (reported, not fitted)
    "rows": pa.int64(),
    "ms": pa.float64(),
}
# (path, what) -> the table's key
KEYS = {
    ("sample", "gpu_ms"): "gpu_ms",
    ("sample", "host_ms"): "host_ms",
    ("choose", "gpu_ms"): "spec_gpu_ms",
    ("choose", "host_ms"): "spec_host_ms",
}


class SamplingFileError(ValueError):
    """A sampling sweep that cannot be read or fitted (the message names the file)."""


def write_sampling(path: str | Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """The rows as parquet with `meta`, whole or not at all (temp + rename)."""
    return write_rows(path, rows, COLUMNS, META_KEY, meta)


def read_sampling(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, metadata) of a sampling sweep; SamplingFileError names what is wrong."""
    table, meta = read_rows(path, COLUMNS, META_KEY, "a sampling sweep", SamplingFileError)
    return table.select(list(COLUMNS)).to_pylist(), meta


def fit_sampling(path: str | Path, vocab: int | None = None) -> dict[str, Any]:
    """The profile's `sampling` table from one sweep. `vocab`: the profile's model's vocabulary,
    which the sweep's must be (the sweep times the sampler alone: a model of the same
    vocabulary samples the same, so one sweep serves llama3.2-1b and llama3-8b)."""
    rows, meta = read_sampling(path)
    if vocab is not None and meta.get("vocab") != vocab:
        got = f"{meta.get('vocab')} ('{meta.get('model')}')"
        raise SamplingFileError(
            f"{path}: a sampling sweep at a vocabulary of {got}, the runs' model has {vocab}"
        )
    ms: dict[tuple[str, str, str, int], float] = {
        (r["mode"], r["path"], r["what"], int(r["rows"])): float(r["ms"]) for r in rows
    }
    counts = sorted({k[3] for k in ms})
    if not counts:
        raise SamplingFileError(f"{path}: a sampling sweep with no rows")
    table: dict[str, Any] = {"vocab": int(meta["vocab"]), "rows": counts}
    for mode in MODES:
        tables: dict[str, list[float]] = {}
        for (p, what), key in KEYS.items():
            try:
                diff = [ms[(mode, p, what, g)] - ms[(GREEDY, p, what, g)] for g in counts]
            except KeyError as e:
                miss = e.args[0]
                raise SamplingFileError(f"{path}: no {miss[0]} {p} {what} at {miss[3]} rows: a "
                                        "partial sweep") from None  # fmt: skip
            if what == "host_ms":  # the same launches at every size (module docstring)
                diff = [statistics.median(diff)] * len(counts)
            tables[key] = diff
        table[mode] = tables
    return {SAMPLING_KEY: table}


def hot_and_cold(path: str | Path) -> list[str]:
    """Lines of a sweep's host differences over greedy measured after engine-like work (the
    table's) and back to back (hot), the median over the row counts, per mode and path."""
    rows, _ = read_sampling(path)
    ms: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        ms.setdefault((r["mode"], r["path"], r["what"]), []).append(float(r["ms"]))
    lines = []
    for mode in MODES:
        for p in ("sample", "choose"):
            got = [statistics.median(ms[(mode, p, w)]) - statistics.median(ms[(GREEDY, p, w)])
                   if (mode, p, w) in ms else None for w in ("host_ms", "host_hot_ms")]  # fmt: skip
            hot = "hot: not measured" if got[1] is None else f"hot {got[1]:.3f}"
            lines.append(f"  {mode:<14} {p:<7} host over greedy {got[0]:.3f} ms ({hot})")
    return lines


def describe(table: dict[str, Any]) -> list[str]:
    """Lines of a `sampling` table: per mode, what it adds at a few row counts."""
    t = table[SAMPLING_KEY]
    shown = [g for g in t["rows"] if g in (1, 16, 64, 256, 1024)] or t["rows"][-1:]
    at = [t["rows"].index(g) for g in shown]
    head = "  mode           what          " + "".join(f"{g:>9}" for g in shown)
    lines = [f"sampling over greedy (ms at that many rows; vocab {t['vocab']}):", head]
    for mode in MODES:
        for key in ("gpu_ms", "host_ms", "spec_gpu_ms", "spec_host_ms"):
            vals = "".join(f"{t[mode][key][i]:>9.3f}" for i in at)
            lines.append(f"  {mode:<14} {key:<13} {vals}")
    return lines
