"""Importers of public traces into Contract 1 traces: the Azure LLM inference CSV and
ShareGPT-style length CSVs (Mooncake's JSONL, with its prefix blocks, is in mooncake.py).

Problems in an input file are refused with one line naming the file, line (1-based, header =
line 1) and column.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from core.trace import INT32_MAX, Trace, TraceError, make_trace
from sim.workloads.arrivals import arrival_times
from sim.workloads.lengths import LENGTH_COLUMNS

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
AZURE_LICENSE = (
    "CC-BY 4.0; Azure LLM inference trace 2023 (github.com/Azure/AzurePublicDataset), "
    "Patel et al., 'Splitwise: Efficient generative LLM inference using phase splitting', "
    "ISCA 2024"
)


def read_csv_strings(path: str | Path, what: str) -> pa.Table:
    """Every column as strings, so bad values can be reported with their line."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{what} '{p}': no such file")
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


def _need_columns(table: pa.Table, cols: tuple[str, ...], what: str) -> None:
    for c in cols:
        if c not in table.column_names:
            raise TraceError(f"{what} column '{c}': missing (have {', '.join(table.column_names)})")


def import_azure(path: str | Path) -> Trace:
    """Azure LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens): arrival = time since
    the first row's timestamp (rows are in file order; timestamps need not be sorted)."""
    what = f"azure CSV '{path}'"
    table = read_csv_strings(path, "azure CSV")
    _need_columns(table, AZURE_COLUMNS, what)
    stamps = np.asarray(table.column("TIMESTAMP").to_numpy(zero_copy_only=False), dtype=str)
    try:
        ns = stamps.astype("datetime64[ns]").astype(np.int64)
    except ValueError:
        bad = next(i for i, s in enumerate(stamps.tolist()) if not _is_time(s))
        raise TraceError(
            f"{what} line {bad + 2} column 'TIMESTAMP': not a timestamp: {stamps[bad]!r}"
        ) from None
    arrival = (ns - ns[0]) / 1e9
    if (arrival < 0).any():
        row = int(np.argmax(arrival < 0))
        raise TraceError(f"{what} line {row + 2} column 'TIMESTAMP': earlier than the first row")
    prompt = int_column(table, "ContextTokens", what)
    output = int_column(table, "GeneratedTokens", what)
    return make_trace(
        arrival,
        prompt,
        output,
        metadata={
            "source": f"Azure LLM inference trace 2023 ({Path(path).name})",
            "license": AZURE_LICENSE,
            "description": f"{len(arrival)} requests, arrivals as recorded (relative to the "
            "first row); prompt = ContextTokens, output = GeneratedTokens",
        },
    )


def _is_time(s: str) -> bool:
    try:
        np.datetime64(s, "ns")
        return True
    except ValueError:
        return False


def import_lengths_csv(
    path: str | Path,
    rng: np.random.Generator,
    arrival: str,
    rate: float,
    cv: float,
    limit: int | None = None,
) -> Trace:
    """A CSV of (prompt, output) token counts, one row per request in file order (e.g. the
    sarathi-serve ShareGPT stats: num_prefill_tokens, num_decode_tokens), with arrival times
    synthesised by a renewal process (default Poisson) at `rate` req/s."""
    what = f"length CSV '{path}'"
    table = read_csv_strings(path, "length CSV")
    names = table.column_names
    pair = next(((a, b) for a, b in LENGTH_COLUMNS if a in names and b in names), None)
    if pair is None:
        known = ", ".join(f"{a}+{b}" for a, b in LENGTH_COLUMNS)
        raise TraceError(f"{what}: no known length columns (one of {known})")
    if limit is not None:
        table = table.slice(0, limit)
    if table.num_rows == 0:
        raise TraceError(f"{what}: has no rows")
    prompt = int_column(table, pair[0], what)
    output = int_column(table, pair[1], what)
    times = arrival_times(rng, arrival, rate, cv, num_requests=len(prompt))
    return make_trace(
        times,
        prompt,
        output,
        metadata={
            "source": f"length CSV {Path(path).name} (columns {pair[0]}, {pair[1]})",
            "license": "see the source CSV's license",
            "description": f"{len(prompt)} requests in file order, lengths from the CSV, "
            f"{arrival} arrivals at {rate:g} req/s"
            + (f" CV {cv:g}" if arrival in ("gamma", "weibull") else ""),
        },
    )
