"""Prompt and output length distributions: parametric (`fixed`, `uniform`, `lognormal`) or the
empirical joint distribution of (prompt, output) pairs read from a file.

Spec strings (for `--prompt-len` / `--output-len`):
    "128" or "fixed:128"        every request 128 tokens
    "uniform:16:200"            integers 16..200, both ends included
    "lognormal:500:0.8[:MAX]"   median 500, sigma 0.8 of log(length), clipped to 1..MAX
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bubblesim.core.cli import UsageError
from bubblesim.core.trace import TraceError
from bubblesim.workloads.csvfile import int_column, read_csv_strings

# known (prompt, output) column pairs of length files, tried in order
LENGTH_COLUMNS = (
    ("prompt_len", "output_len"),  # a trace (Contract 1) or a plain CSV
    ("num_prefill_tokens", "num_decode_tokens"),  # sarathi-serve ShareGPT stats
    ("ContextTokens", "GeneratedTokens"),  # Azure LLM inference traces
    ("input_length", "output_length"),  # Mooncake
    ("input_tokens", "output_tokens"),
)


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | lognormal
    a: float  # fixed: value; uniform: low; lognormal: median
    b: float = 0.0  # uniform: high; lognormal: sigma
    max_len: int = 2**31 - 1

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            out = np.full(n, self.a)
        elif self.kind == "uniform":
            out = rng.integers(int(self.a), int(self.b), n, endpoint=True)
        else:
            out = np.rint(rng.lognormal(math.log(self.a), self.b, n))
        return np.clip(out, 1, self.max_len).astype(np.int32)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform {int(self.a)}..{int(self.b)}"
        return f"lognormal median {self.a:g} sigma {self.b:g} max {self.max_len}"


def parse_length(spec: str, option: str = "--prompt-len") -> LengthDist:
    parts = spec.strip().split(":")
    try:
        if len(parts) == 1 or (parts[0] == "fixed" and len(parts) == 2):
            d = LengthDist("fixed", int(parts[-1]))
            ok = d.a >= 1
        elif parts[0] == "uniform" and len(parts) == 3:
            d = LengthDist("uniform", int(parts[1]), int(parts[2]))
            ok = 1 <= d.a <= d.b
        elif parts[0] == "lognormal" and len(parts) in (3, 4):
            mx = int(parts[3]) if len(parts) == 4 else 2**31 - 1
            d = LengthDist("lognormal", float(parts[1]), float(parts[2]), mx)
            ok = d.a >= 1 and d.b >= 0 and mx >= 1
        else:
            raise ValueError
    except ValueError:
        raise UsageError(
            f"{option} {spec!r}: expected N, fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA[:MAX]"
        ) from None
    if not ok:
        raise UsageError(f"{option} {spec!r}: lengths must be >= 1 (and LO <= HI)")
    return d


def read_length_pairs(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_len, output_len) int64 arrays from a trace parquet or a CSV with a known pair of
    columns (see LENGTH_COLUMNS). A value that is not an integer >= 1 is refused with its
    row (parquet) or line (CSV)."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"length file '{p}': no such file")
    if p.suffix == ".parquet":
        try:
            table = pq.read_table(p)
        except (pa.ArrowException, OSError) as e:
            raise TraceError(f"length file '{p}': unreadable ({str(e).splitlines()[0]})") from None
    else:
        table = read_csv_strings(p, "length file")
    pair = length_columns(table, f"length file '{p}'")
    out = []
    for col in pair:
        if p.suffix != ".parquet":
            out.append(int_column(table, col, f"length file '{p}'"))
            continue
        arr = table.column(col).combine_chunks()
        if not pa.types.is_integer(arr.type):
            raise TraceError(f"length file '{p}' column '{col}': must be int, got {arr.type}")
        vals = np.asarray(arr.fill_null(0))
        if (bad := np.flatnonzero(vals < 1)).size:
            raise TraceError(f"length file '{p}' row {bad[0]} column '{col}': must be >= 1")
        out.append(vals.astype(np.int64))
    if not len(out[0]):
        raise TraceError(f"length file '{p}': has no rows")
    return out[0], out[1]


def length_columns(table: pa.Table, what: str) -> tuple[str, str]:
    names = table.column_names
    pair = next(((a, b) for a, b in LENGTH_COLUMNS if a in names and b in names), None)
    if pair is None:
        known = ", ".join(f"{a}+{b}" for a, b in LENGTH_COLUMNS)
        raise TraceError(f"{what}: no known length columns (one of {known})")
    return pair


def sample_pairs(
    rng: np.random.Generator, pairs: tuple[np.ndarray, np.ndarray], n: int
) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt, output) pairs drawn with replacement, keeping their joint distribution."""
    idx = rng.integers(0, len(pairs[0]), n)
    return pairs[0][idx].astype(np.int32), pairs[1][idx].astype(np.int32)
