"""The file of a `replay shapes` sweep: one parquet row per synthetic batch, JSON metadata.

Columns: COLUMNS (`gpu_ms` is the median of the clean samples). Metadata under META_KEY: model,
GPU, dtype, versions, date, engine commit, config, sample counts, and since steps are timed
(`measures: "step"`) the envelope (per kind, [min, max] of each axis the rows span) and the grid
(`grid`: axes per family, budget, levels, whether the run was cut). A file without `measures`
is an older sweep that timed forward + logits only (no input copy, no sampling).
`read_sweeps` reads files back for calibration (numpy and pyarrow only: no torch).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bubblesim.core.atomic import replacing
from bubblesim.core.shape import SHAPE_FIELDS
from replay.analysis.shapes_grid import Batch, batch_shape, history_rows
from replay.analysis.steps import CalibrationError

META_KEY = b"replay.shapes"
FORMAT_VERSION = 1
MEASURES = "step"  # metadata `measures`: a run step's GPU interval (older files: forward+logits)
KINDS = ("decode", "mixed")
SHAPE_COLUMNS = SHAPE_FIELDS
COLUMNS = (
    "label",  # the grid family (replay.analysis.shapes_grid; a human hint, never read by calibrate)
    "kind",  # decode | mixed
    *SHAPE_COLUMNS,  # the scheduler's BatchShape of the step
    "max_query_len",  # the host bounds the attention kernels were launched with
    "max_seq_len",
    "graph",  # replayed a decode CUDA graph (with its input finishing and sampling)
    "bucket",  # the graph's batch size (0: eager)
    "spec_k",  # drafts per decode row the config allows (0: no speculative decoding)
    "level",  # grid density: 0 corners, 1 coarse lattice, 2 and 3 refinements
    "gpu_ms",  # median over the clean samples
    "gpu_ms_min",
    "gpu_ms_max",
    "repeats",  # clean samples taken
    "unclean",  # samples rejected: the GPU reached the start mark before the host was done
    "issue_ms",  # median host time from the spin to the step's end mark
    "spin_ms",  # median spin enqueued before the step (0 on CPU)
    "kv_blocks",  # KV blocks the batch's requests hold
    "kv_wrapped",  # the cache has fewer blocks: some requests share blocks
    "history_rows",  # rows whose sampling needs the output history (penalties; older files: 0)
)


@dataclass
class Sample:
    gpu_ms: float
    issue_ms: float
    spin_ms: float


def shape_row(
    batch: Batch,
    samples: Sequence[Sample],
    unclean: int,
    bucket: int,
    max_seq_len: int,
    kv_blocks: int,
    kv_wrapped: bool,
    shape: dict[str, int] | None = None,
    spec_k: int = 0,
    max_query_len: int = 0,
) -> dict[str, Any]:
    """A file row (COLUMNS) for a batch and its clean samples; `shape`: the scheduler's
    BatchShape of the step (default: the grid's view of it,
    replay.analysis.shapes_grid.batch_shape)."""
    g = np.array([s.gpu_ms for s in samples])
    fields = shape if shape is not None else batch_shape(batch.entries)
    return {
        "label": batch.label,
        "kind": batch.kind,
        **{f: int(fields[f]) for f in SHAPE_COLUMNS},
        "max_query_len": max_query_len or batch.max_query_len,
        "max_seq_len": max_seq_len,
        "graph": bool(bucket),
        "bucket": bucket,
        "spec_k": spec_k,
        "level": batch.level,
        "gpu_ms": float(np.median(g)),
        "gpu_ms_min": float(g.min()),
        "gpu_ms_max": float(g.max()),
        "repeats": len(samples),
        "unclean": unclean,
        "issue_ms": float(np.median([s.issue_ms for s in samples])),
        "spin_ms": float(np.median([s.spin_ms for s in samples])),
        "kv_blocks": kv_blocks,
        "kv_wrapped": bool(kv_wrapped),
        "history_rows": history_rows(batch.entries),
    }


# ---- the file -----------------------------------------------------------------------------------
def _table(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> pa.Table:
    types = {
        "label": pa.string(),
        "kind": pa.string(),
        "graph": pa.bool_(),
        "kv_wrapped": pa.bool_(),
        **{c: pa.float64() for c in COLUMNS if c.endswith("_ms") or c.startswith("gpu_ms")},
    }
    arrays = {c: pa.array([r[c] for r in rows], type=types.get(c, pa.int64())) for c in COLUMNS}
    table = pa.table(arrays)
    return table.replace_schema_metadata({META_KEY: json.dumps(meta, allow_nan=False).encode()})


def write_sweep(path: str | Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """The rows as parquet with `meta` under META_KEY, whole or not at all (temp + rename)."""
    p = Path(path)
    table = _table(rows, meta)
    p.parent.mkdir(parents=True, exist_ok=True)
    with replacing(p) as tmp:  # follows the umask; removed on failure
        pq.write_table(table, tmp, compression="zstd")
    return p


@dataclass
class SweepRows:
    """The rows of one or more sweep files, as columns for fitting (replay.analysis.calibrate)."""

    cols: dict[str, np.ndarray]  # SHAPE_FIELDS (+ max_kv_tokens if present), num_tokens, intercept
    gpu_ms: np.ndarray
    decode: np.ndarray  # bool: a pure-decode batch
    graph: np.ndarray  # bool: timed as a CUDA graph replay
    file: np.ndarray  # index into paths
    paths: list[str]
    meta: list[dict[str, Any]]
    bucket: np.ndarray | None = None  # the decode graph's batch size (0: eager; None: no column)
    history_rows: np.ndarray | None = None  # rows with penalties per batch (None: all 0)

    def history(self) -> np.ndarray:
        """bool: batches with rows whose sampling needs the output history (penalties)."""
        if self.history_rows is None:
            return np.zeros(len(self.gpu_ms), bool)
        return self.history_rows > 0

    def subset(self, mask: np.ndarray) -> SweepRows:
        """The rows where `mask` holds (same files and metadata)."""

        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[mask]

        return SweepRows(
            cols={k: v[mask] for k, v in self.cols.items()},
            gpu_ms=self.gpu_ms[mask],
            decode=self.decode[mask],
            graph=self.graph[mask],
            file=self.file[mask],
            paths=self.paths,
            meta=self.meta,
            bucket=cut(self.bucket),
            history_rows=cut(self.history_rows),
        )

    def graph_buckets(self) -> list[int]:
        """The decode graph sizes the sweeps' engines captured (metadata `graph_buckets`), else
        the buckets their rows replayed; sorted."""
        out = {int(b) for m in self.meta for b in m.get("graph_buckets") or ()}
        if self.bucket is not None:
            out |= {int(b) for b in np.unique(self.bucket) if b > 0}
        return sorted(out)

    def __len__(self) -> int:
        return len(self.gpu_ms)


def read_sweep(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A sweep file's columns and metadata; CalibrationError naming the file and the problem."""
    p = Path(path)
    where = f"shapes file '{p}'"
    if not p.is_file():
        raise CalibrationError(f"{where} does not exist")
    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as e:
        raise CalibrationError(f"{where}: not a parquet file ({e})") from None
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise CalibrationError(f"{where}: not written by `replay shapes` (no {META_KEY.decode()})")
    meta = json.loads(raw)
    if meta.get("format") != "replay.shapes" or meta.get("version") != FORMAT_VERSION:
        raise CalibrationError(
            f"{where}: format {meta.get('format')!r} version {meta.get('version')!r}, "
            f"expected replay.shapes version {FORMAT_VERSION}"
        )
    required = ("kind", *SHAPE_FIELDS, "graph", "gpu_ms")
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise CalibrationError(
            f"{where}: missing column(s) {missing} (an older sweep? run `replay shapes` again)"
        )
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    if len(table) == 0:
        raise CalibrationError(f"{where}: no rows")
    gpu = cols["gpu_ms"].astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(gpu) | (gpu <= 0))
    if bad.size:
        raise CalibrationError(
            f"{where}: row {int(bad[0])}: gpu_ms {float(gpu[bad[0]])!r} is not > 0"
        )
    kind = cols["kind"].astype(str)
    decode = cols["num_prefill_reqs"] == 0
    wrong = np.flatnonzero((kind != np.where(decode, "decode", "mixed")) | (cols["num_reqs"] < 1))
    if wrong.size:
        i = int(wrong[0])
        raise CalibrationError(
            f"{where}: row {i}: kind {kind[i]!r} does not match num_prefill_reqs "
            f"{int(cols['num_prefill_reqs'][i])} / num_reqs {int(cols['num_reqs'][i])}"
        )
    return cols, meta


def read_sweeps(paths: Sequence[str | Path]) -> SweepRows:
    parts = [read_sweep(p) for p in paths]
    fields = [f for f in SHAPE_COLUMNS if all(f in c for c, _ in parts)]
    cols = {
        f: np.concatenate([c[f] for c, _ in parts]).astype(np.float64)
        for f in dict.fromkeys([*SHAPE_FIELDS, *fields])
    }
    cols["num_tokens"] = cols["prefill_tokens"] + cols["decode_tokens"]
    cols["intercept"] = np.ones(len(cols["num_tokens"]))
    return SweepRows(
        cols=cols,
        gpu_ms=np.concatenate([c["gpu_ms"] for c, _ in parts]).astype(np.float64),
        decode=np.concatenate([c["num_prefill_reqs"] == 0 for c, _ in parts]),
        graph=np.concatenate([c["graph"].astype(bool) for c, _ in parts]),
        file=np.concatenate([np.full(len(c["gpu_ms"]), i) for i, (c, _) in enumerate(parts)]),
        paths=[str(p) for p in paths],
        meta=[m for _, m in parts],
        bucket=np.concatenate(
            [
                c["bucket"].astype(np.int64)
                if "bucket" in c
                else np.zeros(len(c["gpu_ms"]), np.int64)
                for c, _ in parts
            ]
        ),  # fmt: skip
        history_rows=np.concatenate(
            [c.get("history_rows", np.zeros(len(c["gpu_ms"]), np.int64)) for c, _ in parts]
        ).astype(np.int64),
    )
