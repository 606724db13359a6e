"""A sweep's rows as one parquet file with its metadata in the schema (`replay idlegap`,
`replay sampling`): written whole or not at all, read back with one error naming the file."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bubblesim.core.atomic import replacing


def write_rows(
    path: str | Path, rows: Sequence[Mapping[str, Any]], columns: Mapping[str, pa.DataType],
    meta_key: bytes, meta: Mapping[str, Any],
) -> Path:  # fmt: skip
    """The rows (one value per column each) as parquet with `meta` under `meta_key`, whole or
    not at all (temp + rename)."""
    p = Path(path)
    arrays = {c: pa.array([r[c] for r in rows], type=t) for c, t in columns.items()}
    table = pa.table(arrays).replace_schema_metadata(
        {meta_key: json.dumps(meta, allow_nan=False).encode()}
    )
    p.parent.mkdir(parents=True, exist_ok=True)
    with replacing(p) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return p


def read_rows(
    path: str | Path, columns: Mapping[str, pa.DataType], meta_key: bytes, what: str,
    error: type[ValueError],
) -> tuple[pa.Table, dict[str, Any]]:  # fmt: skip
    """(the table, its metadata) of a file `write_rows` wrote; `error` (naming the file) when
    it is no readable parquet, has no `meta_key` (it is no `what`) or lacks a column."""
    p = Path(path)
    try:
        table = pq.read_table(p)
    except (OSError, pa.ArrowInvalid) as e:
        raise error(f"{p}: not a readable parquet file ({e})") from None
    raw = (table.schema.metadata or {}).get(meta_key)
    if raw is None:
        raise error(f"{p}: not {what} (no '{meta_key.decode()}' metadata)")
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise error(f"{p}: {what.split(' ', 1)[-1]} without column(s) {', '.join(missing)}")
    return table, json.loads(raw)
