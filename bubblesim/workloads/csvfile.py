"""CSV input read as strings, so a bad value is reported with its line (1-based, header = 1)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from bubblesim.core.trace import INT32_MAX, TraceError


def read_csv_strings(path: str | Path, what: str) -> pa.Table:
    """Every column as strings, so bad values can be reported with their line."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{what} '{p}': no such file")
    if p.stat().st_size == 0:
        raise TraceError(f"{what} '{p}': the file is empty")
    with open(p, newline="", encoding="utf-8", errors="replace") as f:
        names = next(csv.reader(f), [])
    try:
        return pacsv.read_csv(
            p, convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in names})
        )
    except pa.ArrowException as e:
        raise TraceError(f"{what} '{p}': not a readable CSV ({str(e).splitlines()[0]})") from None


def int_column(table: pa.Table, col: str, what: str, lo: int = 1) -> np.ndarray:
    arr = pc.utf8_trim_whitespace(table.column(col).combine_chunks())
    ok_arr = pc.match_substring_regex(arr, r"^[+-]?\d+(\.0*)?$").fill_null(False)
    ok = np.asarray(ok_arr)
    numbers = pc.cast(pc.if_else(ok_arr, arr, pa.scalar("0")), pa.float64())
    floats = np.asarray(numbers)
    bad = ~ok | (floats < lo) | (floats > INT32_MAX)
    if bad.any():
        row = int(np.argmax(bad))
        got = arr[row].as_py()
        why = f"must be an integer in {lo}..{INT32_MAX}, got {got!r}"
        raise TraceError(f"{what} line {row + 2} column '{col}': {why}")
    return floats.astype(np.int64)
