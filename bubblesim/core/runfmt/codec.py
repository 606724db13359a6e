"""Compact, lossless parquet for a run's tables (format version 2).

A float64 column is stored as int64: its IEEE-754 bit patterns, either alone or minus the bit
patterns of another float64 column of the same table (its `ref`), optionally as row-to-row
differences of those (`diffed`), and DELTA_BINARY_PACKED packs the row-to-row differences of
what is stored. So a time column costs about the bits of
its step-to-step gaps, a phase that starts where another ends costs nothing, and one that
trails another by a short phase costs the bits of that phase. Refs form a tree chosen per
table on a sample of rows (Prim's minimum spanning tree, `_tree`), so any run's own
structure is used; decoding adds the ref's bits back with the same wrapping int64 arithmetic,
so every value comes back bit for bit (NaN, -0.0 and inf included).

A float64 column whose every value is a whole number of nanoseconds in seconds (`ns / 1e9`
gives it back bit for bit: a measured run's clock readings) is stored the same way but as its
nanoseconds (`NS_KEY`), whose row differences are small integers where the bit patterns' are
not; its NaN rows (canonical NaN only) are marked in a boolean column of their own
(`<NAN_PREFIX><name>`) and hold the previous row's nanoseconds, so they cost no difference.

Integer columns are stored as int32 when every value fits and read back as int64; strings are
dictionary encoded. Every encoded field names its original type in its field metadata, and
the schema carries `bubblesim.codec`: a table without it (format version 1) is read as is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CODEC_KEY = b"bubblesim.codec"
CODEC_VERSION = b"2"  # 2: nanosecond columns (NS_KEY); version 1 tables read as before
READ_VERSIONS = (b"1", b"2")
TYPE_KEY = b"bubblesim.type"  # the column's type in the run format: "float64" or "int64"
REF_KEY = b"bubblesim.ref"  # float64: the column whose bits were subtracted ("" = none)
DIFFED_KEY = b"bubblesim.diffed"  # float64: "1" = the row differences of those bits stored
NS_KEY = b"bubblesim.ns"  # float64: "1" = stored as nanoseconds (value = ns / 1e9), not bits
NAN_PREFIX = "__nan__."  # the boolean column marking a nanosecond column's NaN rows
_NAN_BITS = np.array([np.nan]).view(np.int64)[0]
ZSTD_LEVEL = 3  # levels 6-9 save ~5 % more here and take twice the time
_SAMPLE_WINDOWS, _WINDOW_ROWS = 32, 129  # rows the tree is chosen on: 32 runs of 129
_INT32 = np.iinfo(np.int32)


class CodecError(ValueError):
    """A stored table whose encoding metadata is inconsistent."""


# ---- writing ---------------------------------------------------------------------------------
def write_table(table: pa.Table, path: str | Path) -> None:
    """Write `table` to `path` in the compact encoding (read it back with `read_table`)."""
    enc = encode(table)
    delta = [
        f.name
        for f in enc.schema
        if pa.types.is_integer(f.type) and f.metadata and TYPE_KEY in f.metadata
    ]
    pq.write_table(
        enc,
        path,
        compression="zstd",
        compression_level=ZSTD_LEVEL,
        use_dictionary=[n for n in enc.column_names if n not in delta],
        column_encoding={n: "DELTA_BINARY_PACKED" for n in delta},
    )


def encode(table: pa.Table) -> pa.Table:
    """The stored form of `table`: float64 columns as int64 bit differences along `_tree`,
    int64 columns that fit as int32; other columns unchanged."""
    floats = [f.name for f in table.schema if pa.types.is_float64(f.type)]
    bits = {n: _bits(table.column(n)) for n in floats}
    nans: dict[str, np.ndarray] = {}  # nanosecond columns: their NaN rows
    for n in floats:
        as_ns = _nanoseconds(bits[n])
        if as_ns is not None:
            bits[n], nans[n] = as_ns
    refs = _tree(bits)
    fields, arrays = [], []
    for f in table.schema:
        col = table.column(f.name)
        if f.name in bits:
            ref, diffed = refs[f.name]
            stored = _stored(bits[f.name] - bits[ref] if ref else bits[f.name], diffed)
            meta = {TYPE_KEY: b"float64", REF_KEY: ref.encode(), DIFFED_KEY: b"%d" % diffed}
            if f.name in nans:
                meta[NS_KEY] = b"1"
            fields.append(pa.field(f.name, pa.int64(), nullable=False, metadata=meta))
            arrays.append(pa.array(stored))
            if f.name in nans:
                fields.append(pa.field(NAN_PREFIX + f.name, pa.bool_(), nullable=False))
                arrays.append(pa.array(nans[f.name]))
        elif pa.types.is_int64(f.type) and col.null_count == 0 and _fits_int32(col):
            fields.append(pa.field(f.name, pa.int32(), metadata={TYPE_KEY: b"int64"}))
            arrays.append(col.cast(pa.int32()))
        elif pa.types.is_int64(f.type):
            fields.append(f.with_metadata({TYPE_KEY: b"int64"}))
            arrays.append(col)
        else:
            fields.append(f)
            arrays.append(col)
    meta = {**(table.schema.metadata or {}), CODEC_KEY: CODEC_VERSION}
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=meta))


def _bits(col: pa.ChunkedArray) -> np.ndarray:
    if col.null_count:
        raise CodecError("a float64 column with nulls cannot be encoded (runs use NaN)")
    return np.ascontiguousarray(col.to_numpy(), dtype=np.float64).view(np.int64)


def _nanoseconds(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(nanoseconds, NaN rows) of a float64 column given as bits, if `ns / 1e9` gives every
    value back bit for bit and every other value is the canonical NaN; NaN rows take the
    previous row's nanoseconds (0 before the first value). None otherwise."""
    v = bits.view(np.float64)
    nan = bits == _NAN_BITS
    ok = ~nan
    if not np.isfinite(v[ok]).all() or (np.abs(v[ok]) >= 9e9).any():  # beyond int64 ns
        return None
    ns = np.zeros(v.size, dtype=np.int64)
    ns[ok] = np.round(v[ok] * 1e9).astype(np.int64)
    if not np.array_equal((ns[ok] / 1e9).view(np.int64), bits[ok]):
        return None
    if nan.any():  # forward fill: the previous row's value (row differences 0 there)
        last = np.maximum.accumulate(np.where(ok, np.arange(v.size), -1))
        ns = np.where(last >= 0, ns[np.maximum(last, 0)], 0)
    return ns, nan


def _fits_int32(col: pa.ChunkedArray) -> bool:
    if len(col) == 0:
        return True
    a = col.to_numpy()
    return bool(a.min() >= _INT32.min and a.max() <= _INT32.max)


def _tree(bits: dict[str, np.ndarray]) -> dict[str, tuple[str, int]]:
    """Each float column's (ref, diffed): the minimum spanning tree, grown from a virtual root
    ("" = stored alone), whose edge cost is the packed size of a sample of the column stored
    along it, with or without row differences taken first (`_stored`)."""
    names = list(bits)
    sample = {n: _sample(b) for n, b in bits.items()}
    pairs = [(j, i) for j in range(len(names)) for i in range(-1, j)]  # i = -1: alone
    cands = [sample[names[j]] - sample[names[i]] if i >= 0 else sample[names[j]] for j, i in pairs]
    sizes = _packed_sizes([_stored(c, k) for c in cands for k in (0, 1)])
    cost: dict[tuple[int, int], tuple[int, int]] = {}  # (column, ref) -> (bytes, diffed)
    for n, (j, i) in enumerate(pairs):
        cost[j, i] = cost[i, j] = min((sizes[2 * n], 0), (sizes[2 * n + 1], 1))
    best = [cost[j, -1] for j in range(len(names))]  # cheapest way yet to store each column
    parent = [-1] * len(names)
    todo = list(range(len(names)))
    while todo:
        i = min(todo, key=lambda j: (best[j][0], j))
        todo.remove(i)
        for j in todo:
            if cost[j, i][0] < best[j][0]:
                best[j], parent[j] = cost[j, i], i
    refs = [names[i] if i >= 0 else "" for i in parent]
    return {n: (refs[j], best[j][1]) for j, n in enumerate(names)}


def _packed_sizes(columns: list[np.ndarray]) -> list[int]:
    """Bytes each int64 column takes in `write_table`'s encoding (one parquet write of all)."""
    if not columns:
        return []
    table = pa.table({str(i): c for i, c in enumerate(columns)})
    buf = pa.BufferOutputStream()
    pq.write_table(
        table,
        buf,
        compression="zstd",
        compression_level=ZSTD_LEVEL,
        use_dictionary=False,
        write_statistics=False,
        column_encoding="DELTA_BINARY_PACKED",
    )
    meta = pq.read_metadata(pa.BufferReader(buf.getvalue())).row_group(0)
    return [meta.column(i).total_compressed_size for i in range(meta.num_columns)]


def _stored(x: np.ndarray, diffed: int) -> np.ndarray:
    """`x` (int64) with its row differences taken `diffed` (0 or 1) times; the first row is
    kept (a difference from 0). Wrapping int64 arithmetic: exact."""
    if not diffed:
        return x
    out = x.copy()
    np.subtract(x[1:], x[:-1], out=out[1:])
    return out


def _sample(b: np.ndarray) -> np.ndarray:
    """Evenly spaced runs of consecutive rows, joined (all rows of a short table)."""
    n = b.size
    if n <= _SAMPLE_WINDOWS * _WINDOW_ROWS:
        return b
    starts = np.linspace(0, n - _WINDOW_ROWS, _SAMPLE_WINDOWS).astype(np.int64)
    return b[(starts[:, None] + np.arange(_WINDOW_ROWS)).ravel()]


# ---- reading ---------------------------------------------------------------------------------
def read_table(path: str | Path) -> pa.Table:
    """A table written by `write_table` (or a plain format-version-1 parquet file), decoded."""
    return decode(pq.read_table(path))


def decode(table: pa.Table) -> pa.Table:
    """Undo `encode`; a table without the codec key is returned unchanged."""
    meta = table.schema.metadata or {}
    if CODEC_KEY not in meta:
        return table
    if meta[CODEC_KEY] not in READ_VERSIONS:
        versions = ", ".join(v.decode() for v in READ_VERSIONS)
        raise CodecError(f"codec version {meta[CODEC_KEY].decode()!r}, this code reads {versions}")
    fields = {f.name: f for f in table.schema}
    done: dict[str, np.ndarray] = {}

    def float_bits(name: str, chain: tuple[str, ...]) -> np.ndarray:
        """`name`'s bits; `chain`: the columns whose refs led here."""
        if name in done:
            return done[name]
        f = fields.get(name)
        if f is None or not f.metadata or f.metadata.get(TYPE_KEY) != b"float64":
            raise CodecError(f"column {chain[-1]!r}: its ref {name!r} is not an encoded float")
        if name in chain:
            raise CodecError(f"column {name!r}: refs form a cycle ({' -> '.join(chain)})")
        out = table.column(name).to_numpy().astype(np.int64)
        if f.metadata.get(DIFFED_KEY) == b"1":
            np.cumsum(out, out=out)  # wraps: exact
        ref = f.metadata.get(REF_KEY, b"").decode()
        if ref:
            out += float_bits(ref, (*chain, name))
        done[name] = out
        return out

    out_fields, arrays = [], []
    for f in table.schema:
        kind = (f.metadata or {}).get(TYPE_KEY)
        plain = _without(f.metadata)
        if f.name.startswith(NAN_PREFIX):
            continue  # read with its nanosecond column
        if kind == b"float64":
            arrays.append(pa.array(_float(f, float_bits(f.name, ()), table)))
            out_fields.append(pa.field(f.name, pa.float64(), metadata=plain))
        elif kind == b"int64":
            arrays.append(table.column(f.name).cast(pa.int64()))
            out_fields.append(pa.field(f.name, pa.int64(), metadata=plain))
        else:
            arrays.append(table.column(f.name))
            out_fields.append(f)
    rest = {k: v for k, v in meta.items() if k != CODEC_KEY}
    return pa.Table.from_arrays(arrays, schema=pa.schema(out_fields, metadata=rest or None))


def _float(f: pa.Field, stored: np.ndarray, table: pa.Table) -> np.ndarray:
    """A float column's values from its decoded int64 form: bits, or nanoseconds (with the
    NaN rows its boolean column marks)."""
    if (f.metadata or {}).get(NS_KEY) != b"1":
        return stored.view(np.float64)
    nan_col = NAN_PREFIX + f.name
    if nan_col not in table.column_names:
        raise CodecError(f"column {f.name!r}: stored as nanoseconds without {nan_col!r}")
    out = stored / 1e9
    out[table.column(nan_col).to_numpy(zero_copy_only=False)] = np.nan
    return out


def _without(meta: dict[bytes, bytes] | None) -> dict[bytes, bytes] | None:
    drop = (TYPE_KEY, REF_KEY, DIFFED_KEY, NS_KEY)
    rest = {k: v for k, v in (meta or {}).items() if k not in drop}
    return rest or None
