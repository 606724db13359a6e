"""An all-reduce sweep file (`python -m replay allreduce`, replay/gpu/nccl_sweep.py) and its fit
into the profile keys the simulator reads (`gpu_pass.allreduce`, sim.cost.collective).

File: one parquet row per (mode, world_size, bytes): the median per-call time over `samples`
samples, each the slowest rank's mean over `iters` back-to-back calls. Metadata key META_KEY:
JSON with the GPU preset name, the device name, backend, dtype, date, torch and NCCL versions.

Fit (sim.cost.collective's ring model, relative least squares over every row with n > 1 of one
mode):

    ms = latency_ms + latency_ms_per_peer x (n - 1) + c x moved_bytes / link_bytes_per_ms

with moved_bytes = 2 (n - 1) / n x bytes and c = 1 / bw_efficiency. Rows are weighted by
1 / ms, so a 1 KB call and a 256 MB call count alike (the sweep spans five decades). With one
world size the per-peer latency is not identifiable: it is set to 0 and said so. An efficiency
above 1 (NVLink SHARP all-reduces beat the ring's bytes) is capped at 1, and said so. Pure
numpy and pyarrow: runs where the sweep ran (no polars there).

Rows of mode "oneshot" (the one-shot kernel, config tp_allreduce "oneshot") fit the profile's
`gpu_pass.allreduce_oneshot` the same way, over only the sizes the shared rule sends to the
kernel on their world size (bubblesim.core.collectives.uses_oneshot; larger ones take NCCL):

    ms = latency_ms + c x (n - 1) x bytes / link_bytes_per_ms,   bw_efficiency = 1 / c

Rows of mode "fused" (the all-reduce fused with the residual add and RMSNorm, config
tp_allreduce "fused": (n - 1) x bytes pushed to the peers per rank) fit `gpu_pass.allreduce_fused`
the same way, over the sizes the rule sends to that kernel.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bubblesim.core.atomic import replacing
from bubblesim.core.collectives import uses_oneshot
from bubblesim.core.gpus import get_gpu
from sim.cost.collective import allreduce_moved_bytes, oneshot_moved_bytes
from sim.cost.defaults import PROFILE_VERSION

META_KEY = b"bubblesim-allreduce"
FORMAT_VERSION = 1
COLUMNS: dict[str, pa.DataType] = {
    # "graph" (NCCL calls replayed from one CUDA graph), "eager", or "oneshot" (the one-shot
    # kernel, config tp_allreduce "oneshot")
    "mode": pa.string(),
    "world_size": pa.int64(),
    "bytes": pa.int64(),  # message size of one call (the tensor reduced)
    "iters": pa.int64(),  # calls per sample
    "samples": pa.int64(),
    "ms": pa.float64(),  # median over samples of the slowest rank's mean ms per call
    "ms_min": pa.float64(),
    "ms_max": pa.float64(),
}


ONESHOT_MODE = "oneshot"
FUSED_MODE = "fused"
SMALL_KERNEL_MODES = (ONESHOT_MODE, FUSED_MODE)  # each fits gpu_pass.allreduce_<mode>
_KERNEL_NAME = {ONESHOT_MODE: "one-shot", FUSED_MODE: "fused"}  # in messages


class SweepFileError(ValueError):
    """A file that is not an all-reduce sweep, or one the fit cannot use: one line."""


def write_sweep(path: str | Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """Write the rows (dicts with COLUMNS' keys) atomically."""
    cols = {k: pa.array([r[k] for r in rows], t) for k, t in COLUMNS.items()}
    table = pa.table(cols)
    info = {"format_version": FORMAT_VERSION, **meta}
    table = table.replace_schema_metadata({META_KEY: json.dumps(info).encode()})
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with replacing(p) as tmp:
        pq.write_table(table, tmp)
    return p


@dataclass
class Sweep:
    meta: dict[str, Any]
    cols: dict[str, np.ndarray]


def read_sweep(path: str | Path) -> Sweep:
    p = Path(path)
    if not p.is_file():
        raise SweepFileError(f"all-reduce sweep '{p}' does not exist")
    try:
        table = pq.read_table(p)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise SweepFileError(f"'{p}' is not a parquet file: {e}") from None
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise SweepFileError(f"'{p}' is not an all-reduce sweep (no {META_KEY.decode()} metadata)")
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise SweepFileError(f"all-reduce sweep '{p}': column '{missing[0]}' missing")
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in COLUMNS}
    return Sweep(json.loads(raw), cols)


@dataclass
class AllreduceFit:
    params: dict[str, float]  # the profile's gpu_pass.allreduce
    world_sizes: list[int]
    rows: int
    rms_rel: float  # root mean square of (predicted - measured) / measured over the rows
    max_rel: float
    notes: list[str] = field(default_factory=list)


def fit_allreduce(
    world_size: np.ndarray, nbytes: np.ndarray, ms: np.ndarray, link_gb_per_s: float
) -> AllreduceFit:
    """Fit latency_ms, latency_ms_per_peer, bw_efficiency (module doc) to measured calls."""
    n = np.asarray(world_size, dtype=np.float64)
    b = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(ms, dtype=np.float64)
    keep = (n > 1) & np.isfinite(t) & (t > 0)
    n, b, t = n[keep], b[keep], t[keep]
    if len(t) < 3:
        raise SweepFileError(f"the fit needs 3 or more timed calls on 2+ GPUs, got {len(t)}")
    if link_gb_per_s <= 0:
        raise SweepFileError("the GPU has no link bandwidth (bubblesim.core.gpus link_gb_per_s)")
    link_bytes_per_ms = link_gb_per_s * 1e9 / 1e3
    x_bw = allreduce_moved_bytes(b, n.astype(np.int64)) / link_bytes_per_ms  # ms at 100 %
    sizes = sorted({int(v) for v in n})
    notes: list[str] = []
    one_size = len(sizes) == 1
    design = np.stack([np.ones_like(t), x_bw] if one_size else [np.ones_like(t), n - 1, x_bw], 1)
    w = 1.0 / t
    coef, *_ = np.linalg.lstsq(design * w[:, None], t * w, rcond=None)
    if one_size:
        lat, per_peer, c = float(coef[0]), 0.0, float(coef[1])
        notes.append(
            f"one world size ({sizes[0]}): latency_ms_per_peer is not identifiable, set to 0 "
            "(latency_ms holds the whole per-call latency at that size)"
        )
    else:
        lat, per_peer, c = (float(v) for v in coef)
    if c <= 0:
        raise SweepFileError("the bandwidth term fitted <= 0: the sweep needs larger messages")
    eff = 1.0 / c
    if eff > 1.0:
        notes.append(
            f"bw_efficiency fitted {eff:.3f} > 1 (the collective beat the ring's bytes over "
            f"{link_gb_per_s:g} GB/s, e.g. NVLink SHARP): capped at 1"
        )
        eff = 1.0
    if lat < 0 or per_peer < 0:
        notes.append(
            f"a latency fitted < 0 (latency_ms {lat:.4g}, per peer {per_peer:.4g}): set to 0"
        )
        lat, per_peer = max(lat, 0.0), max(per_peer, 0.0)
    pred = lat + per_peer * (n - 1) + x_bw / eff
    rel = (pred - t) / t
    return AllreduceFit(
        {"latency_ms": lat, "latency_ms_per_peer": per_peer, "bw_efficiency": eff},
        sizes,
        len(t),
        float(np.sqrt(np.mean(rel**2))),
        float(np.max(np.abs(rel))),
        notes,
    )


def fit_oneshot(
    world_size: np.ndarray,
    nbytes: np.ndarray,
    ms: np.ndarray,
    link_gb_per_s: float,
    mode: str = ONESHOT_MODE,
) -> AllreduceFit:
    """Fit a one-kernel reduction's latency_ms and bw_efficiency (module doc; `mode`: oneshot
    or fused) to measured calls, over the rows whose size the rule sends to it on their world
    size (the others ignored)."""
    n = np.asarray(world_size, dtype=np.int64)
    b = np.asarray(nbytes, dtype=np.int64)
    t = np.asarray(ms, dtype=np.float64)
    name = _KERNEL_NAME.get(mode, mode)
    rule = np.array([uses_oneshot(mode, int(x), int(k)) for x, k in zip(b, n)], bool)
    keep = rule & np.isfinite(t) & (t > 0)
    if keep.sum() < 3:
        raise SweepFileError(
            f"the {name} fit needs 3 or more timed calls of sizes the rule sends to the kernel "
            f"(bubblesim.core.collectives.ONESHOT_MAX_BYTES), got {int(keep.sum())}"
        )
    if link_gb_per_s <= 0:
        raise SweepFileError("the GPU has no link bandwidth (bubblesim.core.gpus link_gb_per_s)")
    n, b, t = n[keep], b[keep].astype(np.float64), t[keep]
    link_bytes_per_ms = link_gb_per_s * 1e9 / 1e3
    x_bw = oneshot_moved_bytes(b, n) / link_bytes_per_ms  # ms at 100 %
    design = np.stack([np.ones_like(t), x_bw], 1)
    w = 1.0 / t
    coef, *_ = np.linalg.lstsq(design * w[:, None], t * w, rcond=None)
    lat, c = float(coef[0]), float(coef[1])
    if c <= 0:
        raise SweepFileError(
            f"the {name} bandwidth term fitted <= 0: the sweep needs a wider range of sizes"
        )
    notes: list[str] = []
    eff = 1.0 / c
    if eff > 1.0:
        notes.append(
            f"{name} bw_efficiency fitted {eff:.3f} > 1 (moved the peers' copies faster than "
            f"{link_gb_per_s:g} GB/s): capped at 1"
        )
        eff = 1.0
    if lat < 0:
        notes.append(f"the {name} latency fitted < 0 ({lat:.4g} ms): set to 0")
        lat = 0.0
    sizes = sorted({int(v) for v in n})
    pred = lat + x_bw / eff
    rel = (pred - t) / t
    return AllreduceFit(
        {"latency_ms": lat, "bw_efficiency": eff},
        sizes,
        len(t),
        float(np.sqrt(np.mean(rel**2))),
        float(np.max(np.abs(rel))),
        notes,
    )


def _gpu_spec(sweep: Sweep, gpu: str | None) -> Any:
    name = gpu or sweep.meta.get("gpu")
    if not name:
        raise SweepFileError("the sweep names no GPU preset: give --gpu")
    return get_gpu(str(name))


def has_mode(sweep: Sweep, mode: str) -> bool:
    return bool((sweep.cols["mode"] == mode).any())


def fit_sweep_oneshot(
    sweep: Sweep, gpu: str | None = None, mode: str = ONESHOT_MODE
) -> AllreduceFit:
    """Fit the sweep's rows of a one-kernel `mode` ("oneshot" or "fused"; fit_oneshot), against
    the GPU preset named by `gpu` or the file."""
    spec = _gpu_spec(sweep, gpu)
    if not has_mode(sweep, mode):
        raise SweepFileError(f"the sweep has no '{mode}' rows")
    c, sel = sweep.cols, sweep.cols["mode"] == mode
    return fit_oneshot(
        c["world_size"][sel], c["bytes"][sel], c["ms"][sel], spec.link_gb_per_s, mode
    )


def fit_sweep(sweep: Sweep, mode: str = "graph", gpu: str | None = None) -> AllreduceFit:
    """Fit one mode's rows of a sweep, against the GPU preset named by `gpu` or the file."""
    spec = _gpu_spec(sweep, gpu)
    modes = sweep.cols["mode"]
    sel = modes == mode
    if not sel.any():
        have = sorted({str(m) for m in modes})
        raise SweepFileError(f"the sweep has no '{mode}' rows (modes: {', '.join(have)})")
    c = sweep.cols
    return fit_allreduce(c["world_size"][sel], c["bytes"][sel], c["ms"][sel], spec.link_gb_per_s)


def fit_profile(
    sweep: Sweep,
    res: AllreduceFit | None,
    mode: str,
    source: str,
    oneshot: AllreduceFit | None = None,
    fused: AllreduceFit | None = None,
) -> dict[str, Any]:
    """A partial cost profile with the fitted keys (merge it over another with
    sim.cost.merge_profile, or pass it as the config's profile): gpu_pass.allreduce from
    `res` (the NCCL rows of `mode`), gpu_pass.allreduce_oneshot from `oneshot`,
    gpu_pass.allreduce_fused from `fused`, each if given."""
    meta = sweep.meta
    where = f"{source} ({meta.get('device', '?')}, {meta.get('backend', '?')})"
    notes, gpu_pass = [], {}
    for key, fit, rows in (
        ("allreduce", res, mode),
        ("allreduce_oneshot", oneshot, ONESHOT_MODE),
        ("allreduce_fused", fused, FUSED_MODE),
    ):
        if fit is None:
            continue
        gpu_pass[key] = fit.params
        notes.append(
            f"gpu_pass.{key} fitted on {fit.rows} '{rows}' rows, world sizes "
            f"{fit.world_sizes}; rms rel error {100 * fit.rms_rel:.1f} %"
        )
    if not gpu_pass:
        raise SweepFileError("nothing to fit: no NCCL, one-shot or fused fit")
    return {
        "version": PROFILE_VERSION,
        "gpu": str(meta.get("gpu", "")) or None,
        "date": dt.date.today().isoformat(),
        "notes": f"{where}: {'; '.join(notes)}",
        "source_runs": [source],
        "gpu_pass": gpu_pass,
    }
