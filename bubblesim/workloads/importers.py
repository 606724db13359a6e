"""Importers of public traces into Contract 1 traces: the Azure LLM inference CSV and
ShareGPT-style length CSVs (Mooncake's JSONL, with its prefix blocks, is in mooncake.py).

Problems in an input file are refused with one line naming the file, line (1-based, header =
line 1) and column.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from bubblesim.core.trace import Trace, TraceError, make_trace
from bubblesim.workloads.arrivals import arrival_times
from bubblesim.workloads.csvfile import int_column, read_csv_strings
from bubblesim.workloads.lengths import length_columns

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
AZURE_LICENSE = (
    "CC-BY 4.0; Azure LLM inference trace 2023 (github.com/Azure/AzurePublicDataset), "
    "Patel et al., 'Splitwise: Efficient generative LLM inference using phase splitting', "
    "ISCA 2024"
)


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
    if table.num_rows == 0:
        raise TraceError(f"{what}: has no rows")
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
    pair = length_columns(table, what)
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
