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

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
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
ZSTD_LEVEL = 1  # level 3 saves ~3-4 % of a steps table and takes ~1.2-1.6x the time; 6-9 twice
_SAMPLE_WINDOWS, _WINDOW_ROWS = 32, 129  # rows the tree is chosen on: 32 runs of 129
_INT32 = np.iinfo(np.int32)
_NS_PROBE = 1024  # values tried first: a column of other floats fails here, cheaply
ROW_GROUP_ROWS = 1 << 19  # write_chunks: rows encoded and written at a time


class CodecError(ValueError):
    """A stored table whose encoding metadata is inconsistent."""


# ---- writing ---------------------------------------------------------------------------------
def write_table(table: pa.Table, path: str | Path) -> None:
    """Write `table` to `path` in the compact encoding (read it back with `read_table`)."""
    enc = encode(table)
    pq.write_table(enc, path, **_writer_args(enc.schema))


def _writer_args(schema: pa.Schema) -> dict[str, object]:
    delta = [
        f.name
        for f in schema
        if pa.types.is_integer(f.type) and f.metadata and TYPE_KEY in f.metadata
    ]
    return {
        "compression": "zstd",
        "compression_level": ZSTD_LEVEL,
        "use_dictionary": [n for n in schema.names if n not in delta],
        "column_encoding": {n: "DELTA_BINARY_PACKED" for n in delta},
    }


def write_chunks(
    path: str | Path,
    num_rows: int,
    rows: Callable[[int, int], pa.Table],
    row_group_rows: int | None = None,
    plan_rows: Callable[[int, int], pa.Table] | None = None,
) -> None:
    """Write the table whose rows [lo, hi) are `rows(lo, hi)` (`num_rows` in all), holding one
    row group of `row_group_rows` (default ROW_GROUP_ROWS) at a time. A table of one row group
    is `write_table`'s, byte for byte; a longer one is encoded the same way, with the decisions
    that need the whole table (nanoseconds, int32, the tree) taken over all its rows first, and
    a column's row differences running on across row groups, so `read_table` gives back every
    value. `plan_rows` (default `rows`) gives the rows for those decisions: it may leave out
    columns that are neither float64 nor int64.

    The decisions are first taken on the first row group and `_sample`'s rows, then checked on
    every row group as it is encoded; they hold for the whole table exactly when no check
    fails (then they are the whole table's), else the file is written again with decisions
    taken over every row."""
    row_group_rows = row_group_rows or ROW_GROUP_ROWS
    if num_rows <= row_group_rows:
        write_table(rows(0, num_rows), path)
        return
    # the first row group is built once: the guess is taken on it, and it is written first
    first = [rows(0, row_group_rows)]
    plan = _plan_chunks(
        num_rows, plan_rows or rows, row_group_rows, first_only=True, first=first[0]
    )
    try:
        _write_groups(path, num_rows, rows, row_group_rows, plan, first)
    except _PlanMiss:
        plan = _plan_chunks(num_rows, plan_rows or rows, row_group_rows)
        _write_groups(path, num_rows, rows, row_group_rows, plan)


class _PlanMiss(Exception):
    """A row group breaks a decision taken on a sample of rows (nanoseconds, int32)."""


def _write_groups(
    path: str | Path,
    num_rows: int,
    rows: Callable[[int, int], pa.Table],
    row_group_rows: int,
    plan: _Plan,
    first: list[pa.Table] | None = None,
) -> None:
    """The row groups along `plan`; `first` may hold the first one's rows, built already (taken
    out of the list, so that it is not held once written)."""
    carry: dict[str, tuple[int, int]] = {}  # float column -> last (stored value, ns) written
    writer: pq.ParquetWriter | None = None
    pending: Future[None] | None = None  # the previous row group, written by `pool`
    spare = _Spare()
    # one row group is written (parquet releases the GIL) while the next is built and encoded:
    # the same row groups in the same order, one more of them in memory
    with ThreadPoolExecutor(1, thread_name_prefix="parquet") as pool:
        try:
            for lo in range(0, num_rows, row_group_rows):
                lent = spare.lent = []
                hi = min(num_rows, lo + row_group_rows)
                table = first.pop() if lo == 0 and first else rows(lo, hi)
                enc = _encode(table, plan, carry, spare)
                del table
                if writer is None:
                    writer = pq.ParquetWriter(path, enc.schema, **_writer_args(enc.schema))
                if pending is not None:
                    pending.result()
                    spare.give_back()  # the row group before: written, its columns unread
                spare.written_next = lent
                pending = pool.submit(writer.write_table, enc, row_group_size=row_group_rows)
                del enc
            if pending is not None:
                pending.result()
        finally:
            if pending is not None:
                wait([pending])  # never close the file under a write
            if writer is not None:
                writer.close()


class _Spare:
    """Encoded columns handed out again: a row group's are free once the writer wrote it, and
    the row group after next takes them (a new array of a row group's size page-faults fresh
    memory in, ~2-4 ms per 4 MB on a VM, as long as the arithmetic that fills it)."""

    def __init__(self) -> None:
        self.free: dict[tuple[int, str], list[np.ndarray]] = {}
        self.lent: list[np.ndarray] = []  # handed out for the row group being encoded
        self.written_next: list[np.ndarray] = []  # the row group being written

    def empty(self, n: int, dtype: type) -> np.ndarray:
        """An uninitialised (n,) array of `dtype`, lent to the row group being encoded."""
        kept = self.free.get((n, np.dtype(dtype).str))
        out = kept.pop() if kept else np.empty(n, dtype)
        self.lent.append(out)
        return out

    def scratch_done(self, a: np.ndarray) -> None:
        """`a` (lent by `empty`) is not part of the encoded row group: free again now."""
        self.lent.remove(a)
        self.free.setdefault((a.size, a.dtype.str), []).append(a)

    def give_back(self) -> None:
        """The row group being written was written: its columns are free."""
        for a in self.written_next:
            self.free.setdefault((a.size, a.dtype.str), []).append(a)
        self.written_next = []


@dataclass
class _Plan:
    """A table's encoding decisions: float columns' (ref, diffed), which are nanoseconds, which
    int64 columns fit int32."""

    refs: dict[str, tuple[str, int]] = field(default_factory=dict)
    ns: set[str] = field(default_factory=set)
    int32: set[str] = field(default_factory=set)


def encode(table: pa.Table) -> pa.Table:
    """The stored form of `table`: float64 columns as int64 bit differences along `_tree`,
    int64 columns that fit as int32; other columns unchanged."""
    plan = _Plan()
    bits: dict[str, np.ndarray] = {}
    for f in table.schema:
        if pa.types.is_float64(f.type):
            bits[f.name] = b = _bits(table.column(f.name))
            if _nanoseconds(b) is not None:
                plan.ns.add(f.name)
        elif pa.types.is_int64(f.type) and _fits_int32(table.column(f.name)):
            plan.int32.add(f.name)
    plan.refs = _tree({n: _sample(_domain(b, n in plan.ns)[0]) for n, b in bits.items()})
    return _encode(table, plan, None)


def _encode(
    table: pa.Table,
    plan: _Plan,
    carry: dict[str, tuple[int, int]] | None,
    spare: _Spare | None = None,
) -> pa.Table:
    """`table` stored along `plan`. `carry` (chunked writes): each float column's last stored
    value and nanoseconds from the previous rows, updated; None: these are all the rows.
    `spare`: where the stored columns' arrays come from (new ones without)."""
    empty = spare.empty if spare is not None else np.empty
    n = table.num_rows
    values: dict[str, np.ndarray] = {}  # float columns in their stored domain: bits or ns
    nans: dict[str, np.ndarray] = {}
    for name in plan.refs:
        ns = name in plan.ns
        fill = carry[name][1] if carry and name in carry else 0
        values[name], nan = _domain(_bits(table.column(name)), ns, fill)
        if ns:
            nans[name] = nan
    fields, arrays = [], []
    scratch = empty(n, np.int64) if any(r and d for r, d in plan.refs.values()) else None
    for f in table.schema:
        col = table.column(f.name)
        if f.name in plan.refs:
            ref, diffed = plan.refs[f.name]
            v = values[f.name]
            stored = empty(n, np.int64) if ref or diffed else v
            x = np.subtract(v, values[ref], out=scratch if diffed else stored) if ref else v
            if diffed and n:  # `_stored(x, 1)`, into `stored`
                np.subtract(x[1:], x[:-1], out=stored[1:])
                stored[0] = x[0]
            if carry is not None:
                if diffed and f.name in carry and x.size:
                    stored[0] = x[0] - carry[f.name][0]  # wraps, as `_stored`
                if x.size:
                    carry[f.name] = (int(x[-1]), int(values[f.name][-1]))
            meta = {TYPE_KEY: b"float64", REF_KEY: ref.encode(), DIFFED_KEY: b"%d" % diffed}
            if f.name in nans:
                meta[NS_KEY] = b"1"
            fields.append(pa.field(f.name, pa.int64(), nullable=False, metadata=meta))
            arrays.append(pa.array(stored))
            if f.name in nans:
                fields.append(pa.field(NAN_PREFIX + f.name, pa.bool_(), nullable=False))
                arrays.append(pa.array(nans[f.name]))
        elif f.name in plan.int32:  # no nulls, every value fits: numpy casts it as arrow would
            if carry is not None and not _fits_int32(col):
                raise _PlanMiss(f.name)
            fields.append(pa.field(f.name, pa.int32(), metadata={TYPE_KEY: b"int64"}))
            narrow = empty(n, np.int32)
            np.copyto(narrow, col.to_numpy(), casting="unsafe")  # as astype(np.int32)
            arrays.append(pa.array(narrow))
        elif pa.types.is_int64(f.type):
            fields.append(f.with_metadata({TYPE_KEY: b"int64"}))
            arrays.append(col)
        else:
            fields.append(f)
            arrays.append(col)
    if spare is not None and scratch is not None:
        spare.scratch_done(scratch)
    meta = {**(table.schema.metadata or {}), CODEC_KEY: CODEC_VERSION}
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=meta))


def _domain(bits: np.ndarray, ns: bool, fill: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A float column's values as stored before refs and differences: its bits, or its
    nanoseconds with NaN rows taking the previous row's (`fill` before the first), and the
    NaN rows (empty for bits)."""
    if not ns:
        return bits, np.zeros(0, bool)
    out = _nanoseconds(bits, fill)
    if out is None:
        raise _PlanMiss("a column planned as nanoseconds is not")
    return out


def _plan_chunks(
    n: int,
    rows: Callable[[int, int], pa.Table],
    step: int,
    first_only: bool = False,
    first: pa.Table | None = None,
) -> _Plan:
    """`encode`'s decisions for the n rows `rows` gives, reading them `step` at a time: a column
    is nanoseconds / int32 if every chunk is (`first_only`: the first chunk and `_sample`'s
    rows, a guess to check); the tree is chosen on `_sample`'s rows. `first`: the first chunk,
    built already (it may hold more columns than `rows` gives; those are neither float64 nor
    int64)."""
    plan = _Plan()
    floats: list[str] = []
    ns_ok: dict[str, bool] = {}
    lo_hi: dict[str, tuple[int, int] | None] = {}
    windows = [rows(int(s), int(s) + _WINDOW_ROWS) for s in _sample_starts(n)]
    chunks = (
        first if lo == 0 and first is not None else rows(lo, min(n, lo + step))
        for lo in range(0, step if first_only else n, step)
    )
    for k, t in enumerate(chunks if not first_only else [*chunks, *windows]):
        for f in t.schema:
            if pa.types.is_float64(f.type):
                if k == 0:
                    floats.append(f.name)
                if ns_ok.get(f.name, True):
                    ns_ok[f.name] = _nanoseconds(_bits(t.column(f.name))) is not None
            elif pa.types.is_int64(f.type):
                r, old = _int_range(t.column(f.name)), lo_hi.get(f.name, (0, 0))
                if r is None or old is None:
                    lo_hi[f.name] = None  # nulls: stays int64
                else:
                    lo_hi[f.name] = (min(old[0], r[0]), max(old[1], r[1])) if k else r
    plan.ns = {c for c in floats if ns_ok[c]}
    plan.int32 = {
        c for c, r in lo_hi.items() if r is not None and r[0] >= _INT32.min and r[1] <= _INT32.max
    }
    plan.refs = _tree(
        {
            c: np.concatenate([_domain(_bits(w.column(c)), c in plan.ns)[0] for w in windows])
            for c in floats
        }
    )
    return plan


def _int_range(col: pa.ChunkedArray) -> tuple[int, int] | None:
    """(min, max) of an int64 column without nulls ((0, 0) when empty); None with nulls."""
    if col.null_count:
        return None
    if len(col) == 0:
        return (0, 0)
    a = col.to_numpy()
    return int(a.min()), int(a.max())


def _bits(col: pa.ChunkedArray) -> np.ndarray:
    if col.null_count:
        raise CodecError("a float64 column with nulls cannot be encoded (runs use NaN)")
    return np.ascontiguousarray(col.to_numpy(), dtype=np.float64).view(np.int64)


def _nanoseconds(bits: np.ndarray, fill: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
    """(nanoseconds, NaN rows) of a float64 column given as bits, if `ns / 1e9` gives every
    value back bit for bit and every other value is the canonical NaN; NaN rows take the
    previous row's nanoseconds (`fill` before the first value). None otherwise."""
    v = bits.view(np.float64)
    probe = v[:_NS_PROBE]
    probe = probe[bits[:_NS_PROBE] != _NAN_BITS]
    if probe.size and not (  # the full test below, on the first values: most floats fail here
        np.isfinite(probe).all()
        and (np.abs(probe) < 9e9).all()
        and np.array_equal(np.round(probe * 1e9).astype(np.int64) / 1e9, probe)
    ):
        return None
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
        ns = np.where(last >= 0, ns[np.maximum(last, 0)], fill)
    return ns, nan


def _fits_int32(col: pa.ChunkedArray) -> bool:
    r = _int_range(col)
    return r is not None and r[0] >= _INT32.min and r[1] <= _INT32.max


def _tree(bits: dict[str, np.ndarray]) -> dict[str, tuple[str, int]]:
    """Each float column's (ref, diffed): the minimum spanning tree, grown from a virtual root
    ("" = stored alone), whose edge cost is the packed size of a sample of the column stored
    along it, with or without row differences taken first (`_stored`)."""
    names = list(bits)
    sample = bits  # the callers pass `_sample`'s rows
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
    if b.size <= _SAMPLE_WINDOWS * _WINDOW_ROWS:
        return b
    return b[(_sample_starts(b.size)[:, None] + np.arange(_WINDOW_ROWS)).ravel()]


def _sample_starts(n: int) -> np.ndarray:
    """The first rows of `_sample`'s runs in a table of n > 32 * 129 rows."""
    return np.linspace(0, n - _WINDOW_ROWS, _SAMPLE_WINDOWS).astype(np.int64)


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
