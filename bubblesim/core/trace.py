"""The trace (docs/contracts.md Contract 1): one parquet file, one row per request.

pyarrow + numpy only: this runs on the GPU host, which has neither polars nor (in `bubblesim/core/`)
any reason to import torch. Every check is one vectorised pass over a column that reports the
FIRST bad row, so a 1M-row trace reads and validates without building a Python object per row.

Rows are numbered from 0 in file order in every message:
    trace 'x.parquet' row 17 column 'prompt_len': must be >= 1, got 0

Invariants of a `Trace` (checked by `validate` on every read and before every write):
- request ids are unique; 0 <= arrival_s < inf; prompt_len, output_len >= 1;
- when present, len(prompt_ids[i]) == prompt_len[i], len(output_ids[i]) == output_len[i] and
  every id is >= 0 (and < the model's vocab when a model is given);
- 0 <= prefix_len[i] <= prompt_len[i]; prefix_len[i] == 0 when request i has no prefix;
  requests of one prefix group share their first min(prefix_len) prompt tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bubblesim.core.atomic import replacing

if TYPE_CHECKING:
    from bubblesim.core.models import ModelSpec

FORMAT_VERSION = "1"
REQUIRED = ("request_id", "arrival_s", "prompt_len", "output_len")
OPTIONAL = (
    "prompt_ids",
    "output_ids",
    "accept_rate",
    "needs_history",
    "prefix_id",
    "prefix_len",
)
COLUMNS = REQUIRED + OPTIONAL
INT32_MAX = 2**31 - 1


class TraceError(ValueError):
    """A bad trace: the message names the file, and the row and column where there is one."""


# ---- containers -------------------------------------------------------------------------------
@dataclass(eq=False)
class TokenLists:
    """Token sequences stored flat: sequence i is values[offsets[i] : offsets[i + 1]]."""

    values: np.ndarray  # int32 [total]
    offsets: np.ndarray  # int64 [n + 1], offsets[0] == 0, non-decreasing

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]  # a view, no copy

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, rows: np.ndarray) -> TokenLists:
        lens = self.lengths()[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        # source position of each output value: its list's start + its position inside the list
        src = np.repeat(self.offsets[:-1][rows] - offsets[:-1], lens) + np.arange(offsets[-1])
        return TokenLists(self.values[src], offsets)

    @staticmethod
    def from_lists(seqs: Sequence[Sequence[int] | np.ndarray]) -> TokenLists:
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        parts = [np.asarray(s, dtype=np.int64) for s in seqs]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if flat.size and (flat.min() < 0 or flat.max() > INT32_MAX):
            raise TraceError("token ids must be in 0..2**31-1")
        return TokenLists(flat.astype(np.int32), offsets)

    def to_arrow(self) -> pa.Array:
        values = pa.array(self.values, type=pa.int32())
        if self.offsets[-1] <= INT32_MAX:
            return pa.ListArray.from_arrays(pa.array(self.offsets.astype(np.int32)), values)
        return pa.LargeListArray.from_arrays(pa.array(self.offsets), values)


class TraceRow(NamedTuple):
    """One request as plain Python values (what the simulator's arrival process consumes)."""

    row: int  # row in the Trace it came from (use it for prompt_ids[row] etc.)
    request_id: int | str
    arrival_s: float
    prompt_len: int
    output_len: int
    accept_rate: float | None
    needs_history: bool
    prefix_group: int  # -1 = no shared prefix
    prefix_len: int


@dataclass(eq=False)
class Trace:
    """A validated trace as columns. Length n = number of requests, in file order.

    Prefixes are stored dictionary-encoded: `prefix_group[i]` is -1 (no shared prefix) or an
    index into `prefix_keys`, the distinct original `prefix_id` values (int64 or str)."""

    request_id: np.ndarray  # int64 [n], or object [n] of str
    arrival_s: np.ndarray  # float64 [n], seconds since trace start
    prompt_len: np.ndarray  # int32 [n]
    output_len: np.ndarray  # int32 [n]
    prompt_ids: TokenLists | None = None
    output_ids: TokenLists | None = None
    accept_rate: np.ndarray | None = None  # float32 [n] in [0, 1]
    needs_history: np.ndarray | None = None  # bool [n]
    prefix_group: np.ndarray | None = None  # int32 [n], -1 = none
    prefix_keys: np.ndarray | None = None  # int64 or object(str) [num groups]
    prefix_len: np.ndarray | None = None  # int32 [n], 0 where prefix_group == -1
    metadata: dict[str, str] = field(default_factory=dict)  # source, license, description, ...

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def has_token_ids(self) -> bool:
        return self.prompt_ids is not None and self.output_ids is not None

    def history_mask(self) -> np.ndarray:
        n = len(self)
        return self.needs_history if self.needs_history is not None else np.zeros(n, bool)

    def arrival_order(self) -> np.ndarray:
        """Row indices sorted by arrival; ties keep file order (stable)."""
        return np.argsort(self.arrival_s, kind="stable")

    def by_arrival(self) -> Trace:
        """The same requests sorted by arrival (stable); self when already sorted."""
        if len(self) < 2 or bool(np.all(np.diff(self.arrival_s) >= 0)):
            return self
        return self.take(self.arrival_order())

    def take(self, rows: np.ndarray) -> Trace:
        def opt(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[rows]

        return Trace(
            request_id=self.request_id[rows],
            arrival_s=self.arrival_s[rows],
            prompt_len=self.prompt_len[rows],
            output_len=self.output_len[rows],
            prompt_ids=None if self.prompt_ids is None else self.prompt_ids.take(rows),
            output_ids=None if self.output_ids is None else self.output_ids.take(rows),
            accept_rate=opt(self.accept_rate),
            needs_history=opt(self.needs_history),
            prefix_group=opt(self.prefix_group),
            prefix_keys=self.prefix_keys,
            prefix_len=opt(self.prefix_len),
            metadata=dict(self.metadata),
        )

    def rows(self) -> Iterator[TraceRow]:
        """Requests as tuples of Python scalars, in the trace's row order (call `by_arrival()`
        first for arrival order). Each column is converted once with `tolist()`."""
        n = len(self)
        acc = self.accept_rate.tolist() if self.accept_rate is not None else [None] * n
        hist = self.history_mask().tolist()
        group = self.prefix_group.tolist() if self.prefix_group is not None else [-1] * n
        plen = self.prefix_len.tolist() if self.prefix_len is not None else [0] * n
        cols = zip(
            self.request_id.tolist(),
            self.arrival_s.tolist(),
            self.prompt_len.tolist(),
            self.output_len.tolist(),
            acc,
            hist,
            group,
            plen,
        )
        for i, (rid, arr, p, o, a, h, g, pl) in enumerate(cols):
            yield TraceRow(i, rid, arr, p, o, a, h, g, pl)

    def to_table(self) -> pa.Table:
        cols: dict[str, pa.Array] = {
            "request_id": pa.array(self.request_id),
            "arrival_s": pa.array(self.arrival_s, type=pa.float64()),
            "prompt_len": pa.array(self.prompt_len, type=pa.int32()),
            "output_len": pa.array(self.output_len, type=pa.int32()),
        }
        if self.prompt_ids is not None:
            cols["prompt_ids"] = self.prompt_ids.to_arrow()
        if self.output_ids is not None:
            cols["output_ids"] = self.output_ids.to_arrow()
        if self.accept_rate is not None:
            cols["accept_rate"] = pa.array(self.accept_rate, type=pa.float32())
        if self.needs_history is not None:
            cols["needs_history"] = pa.array(self.needs_history, type=pa.bool_())
        if self.prefix_group is not None:
            keys = self.prefix_keys if self.prefix_keys is not None else np.zeros(0, np.int64)
            group = np.asarray(self.prefix_group)
            cols["prefix_id"] = pa.array(keys).take(pa.array(group, mask=group < 0))
            plen = self.prefix_len if self.prefix_len is not None else np.zeros(len(self))
            cols["prefix_len"] = pa.array(plen, type=pa.int32())
        meta = {"trace_format": FORMAT_VERSION, **self.metadata}
        return pa.table(cols).replace_schema_metadata({k: str(v) for k, v in meta.items()})


def encode_prefixes(ids: np.ndarray, has_prefix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(prefix_group, prefix_keys) from per-row ids (any dtype) and a mask of rows that have one.
    Groups are numbered in order of first appearance, so the encoding is deterministic."""
    idx = np.flatnonzero(has_prefix)
    keys, first, inverse = np.unique(ids[idx], return_index=True, return_inverse=True)
    rank = np.empty(len(keys), dtype=np.int32)
    rank[np.argsort(first, kind="stable")] = np.arange(len(keys), dtype=np.int32)
    group = np.full(len(ids), -1, dtype=np.int32)
    group[idx] = rank[inverse]
    return group, keys[np.argsort(first, kind="stable")]


# ---- validation ---------------------------------------------------------------------------------
class _Where:
    """Formats one-line errors for one trace name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def trace(self, why: str) -> TraceError:
        return TraceError(f"trace '{self.name}': {why}")

    def col(self, col: str, why: str) -> TraceError:
        return TraceError(f"trace '{self.name}' column '{col}': {why}")

    def row(self, row: int, col: str, why: str) -> TraceError:
        return TraceError(f"trace '{self.name}' row {row} column '{col}': {why}")


def _first(mask: np.ndarray) -> int | None:
    return int(np.argmax(mask)) if mask.any() else None


def _kind(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "list<int>" if _kind(t.value_type) == "int" else "list<?>"
    return "other"


_KINDS = {  # column -> accepted kinds (first is canonical)
    "request_id": ("int", "string"),
    "arrival_s": ("float", "int"),
    "prompt_len": ("int",),
    "output_len": ("int",),
    "prompt_ids": ("list<int>",),
    "output_ids": ("list<int>",),
    "accept_rate": ("float",),
    "needs_history": ("bool",),
    "prefix_id": ("int", "string"),
    "prefix_len": ("int",),
}


def _column(table: pa.Table, name: str, w: _Where) -> pa.Array:
    arr = table.column(name).combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    kind = _kind(arr.type)
    if kind not in _KINDS[name]:
        want = " or ".join(_KINDS[name])
        raise w.col(name, f"must be {want}, got {arr.type}")
    nullable = name in ("prefix_id", "prefix_len")
    if arr.null_count and not nullable:
        row = _first(np.asarray(arr.is_null()))
        raise w.row(row or 0, name, "must not be null")
    return arr


def _ints(arr: pa.Array, name: str, w: _Where, lo: int, hi: int = INT32_MAX) -> np.ndarray:
    """int64 copy of an integer column, every value in [lo, hi] (nulls read as lo)."""
    vals = np.asarray(arr.fill_null(lo))  # native width: numpy compares any int width exactly
    for bad, why in ((vals < lo, f">= {lo}"), (vals > hi, f"<= {hi}")):
        if (row := _first(bad)) is not None:
            raise w.row(row, name, f"must be {why}, got {vals[row]}")
    return vals.astype(np.int64)


def _floats(arr: pa.Array, name: str, w: _Where, lo: float, hi: float) -> np.ndarray:
    vals = np.asarray(arr.cast(pa.float64()))
    if (row := _first(np.isnan(vals))) is not None:
        raise w.row(row, name, "must not be NaN")
    for bad, why in ((vals < lo, f">= {lo:g}"), (vals > hi, f"<= {hi:g}")):
        if (row := _first(bad)) is not None:
            raise w.row(row, name, f"must be {why}, got {vals[row]}")
    if (row := _first(~np.isfinite(vals))) is not None:
        raise w.row(row, name, f"must be finite, got {vals[row]}")
    return vals


def _ids_key(arr: pa.Array) -> pa.Array:
    return arr.cast(pa.int64()) if _kind(arr.type) == "int" else arr.cast(pa.string())


def _check_unique(ids: pa.Array, w: _Where) -> None:
    if pa.types.is_integer(ids.type) and not ids.null_count:
        # integer ids are their own codes: no hash table (a trace of millions), and ids that
        # ascend (0, 1, 2, ... as generators write them) take no sort
        codes = np.asarray(ids)
        if bool(np.all(codes[1:] > codes[:-1])):
            return
    else:
        codes = np.asarray(pc.dictionary_encode(ids).indices)
    order = np.argsort(codes, kind="stable")
    dup = codes[order[1:]] == codes[order[:-1]]
    if dup.any():
        row = int(order[1:][dup].min())  # earliest row whose id appeared before it
        first = int(np.argmax(codes == codes[row]))
        raise w.row(row, "request_id", f"duplicate id {ids[row].as_py()!r} (also row {first})")


def _token_lists(
    arr: pa.Array, name: str, want_len: np.ndarray, vocab: int | None, w: _Where
) -> tuple[np.ndarray, np.ndarray]:
    """(values int32, offsets int64) of a list<int> column, lengths and ids checked."""
    lens = np.asarray(pc.list_value_length(arr)).astype(np.int64)
    length_of = name.replace("_ids", "_len")
    if (row := _first(lens != want_len)) is not None:
        raise w.row(row, name, f"has {lens[row]} ids but {length_of} is {want_len[row]}")
    flat = arr.flatten()
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])

    def fail(k: int, why: str) -> TraceError:
        row = int(np.searchsorted(offsets, k, side="right") - 1)
        return w.row(row, name, f"{why} (token {k - offsets[row]})")

    if flat.null_count:
        raise fail(_first(np.asarray(flat.is_null())) or 0, "token id must not be null")
    values = np.asarray(flat)  # native int width
    hi, note = (INT32_MAX, "") if vocab is None else (vocab - 1, f" (model vocab {vocab})")
    if (k := _first(values < 0)) is not None:
        raise fail(k, f"token id must be >= 0, got {values[k]}")
    if (k := _first(values > hi)) is not None:
        raise fail(k, f"token id must be <= {hi}{note}, got {values[k]}")
    return values.astype(np.int32), offsets


def _check_shared_prefix(
    group: np.ndarray, plen: np.ndarray, ids: tuple[np.ndarray, np.ndarray], w: _Where
) -> None:
    """Rows of one prefix group agree with the group's first row on min(prefix_len) tokens."""
    values, offsets = ids
    rows = np.flatnonzero(group >= 0)
    if not len(rows):
        return
    first_of_group = np.full(int(group.max()) + 1, -1, dtype=np.int64)
    first_of_group[group[rows][::-1]] = rows[::-1]  # last write wins = the first row
    ref = first_of_group[group[rows]]
    n = np.minimum(plen[rows], plen[ref]).astype(np.int64)
    pos = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    a = values[np.repeat(offsets[rows], n) + pos]
    b = values[np.repeat(offsets[ref], n) + pos]
    if (k := _first(a != b)) is not None:
        i = int(np.searchsorted(np.cumsum(n), k, side="right"))
        raise w.row(
            int(rows[i]),
            "prompt_ids",
            f"differs at token {pos[k]} from row {ref[i]}, which has the same prefix_id "
            f"(rows of a prefix_id share their first prefix_len tokens)",
        )


def validate(
    table: pa.Table, model_spec: ModelSpec | None = None, name: str = "<table>"
) -> pa.Table:
    """Check `table` against Contract 1 (and `model_spec`'s context and vocab when given).
    Returns the canonical table (canonical column order and types, metadata kept).
    Raises TraceError with one line naming the row and column of the first problem."""
    w = _Where(name)
    names = table.column_names
    for col in names:
        if col not in COLUMNS:
            raise w.col(col, f"unknown column (known: {', '.join(COLUMNS)})")
    if len(set(names)) != len(names):
        dup = next(c for c in names if names.count(c) > 1)
        raise w.col(dup, "appears twice")
    for col in REQUIRED:
        if col not in names:
            raise w.col(col, "required column is missing")
    if ("prefix_id" in names) != ("prefix_len" in names):
        have, miss = (
            ("prefix_id", "prefix_len") if "prefix_id" in names else ("prefix_len", "prefix_id")
        )
        raise w.col(miss, f"required when '{have}' is present")
    if table.num_rows == 0:
        raise w.trace("has no rows")
    try:
        return _validate(table, model_spec, w)
    except (pa.ArrowException, OverflowError) as e:  # a safety net: still one clear line
        raise w.trace(f"unreadable values: {str(e).splitlines()[0]}") from None


def _validate(table: pa.Table, model: ModelSpec | None, w: _Where) -> pa.Table:
    names = table.column_names
    col = {c: _column(table, c, w) for c in COLUMNS if c in names}
    ids = _ids_key(col["request_id"])
    _check_unique(ids, w)
    out: dict[str, pa.Array] = {"request_id": ids}
    arrival = _floats(col["arrival_s"], "arrival_s", w, 0.0, np.inf)
    out["arrival_s"] = pa.array(arrival, type=pa.float64())
    lens = {c: _ints(col[c], c, w, 1) for c in ("prompt_len", "output_len")}
    if model is not None:
        total = lens["prompt_len"] + lens["output_len"]
        if (row := _first(total > model.max_context)) is not None:
            raise w.row(
                row,
                "output_len",
                f"prompt_len + output_len = {total[row]} exceeds the context of model "
                f"'{model.name}' ({model.max_context} tokens)",
            )
    for c in ("prompt_len", "output_len"):
        out[c] = pa.array(lens[c].astype(np.int32), type=pa.int32())
    vocab = model.vocab_size if model is not None else None
    token_ids: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for c in ("prompt_ids", "output_ids"):
        if c in col:
            want = lens[c.replace("_ids", "_len")]
            token_ids[c] = _token_lists(col[c], c, want, vocab, w)
            out[c] = TokenLists(*token_ids[c]).to_arrow()
    if "accept_rate" in col:
        out["accept_rate"] = pa.array(
            _floats(col["accept_rate"], "accept_rate", w, 0.0, 1.0), type=pa.float32()
        )
    if "needs_history" in col:
        out["needs_history"] = col["needs_history"].cast(pa.bool_())
    if "prefix_id" in col:
        pid = _ids_key(col["prefix_id"])
        has = ~np.asarray(pid.is_null())
        plen_arr = col["prefix_len"]
        if (row := _first(has & np.asarray(plen_arr.is_null()))) is not None:
            raise w.row(row, "prefix_len", "must not be null where prefix_id is set")
        plen = _ints(plen_arr, "prefix_len", w, 0)
        if (row := _first(plen > lens["prompt_len"])) is not None:
            raise w.row(
                row,
                "prefix_len",
                f"must be <= prompt_len ({lens['prompt_len'][row]}), got {plen[row]}",
            )
        if (row := _first(~has & (plen != 0))) is not None:
            raise w.row(row, "prefix_len", f"must be 0 where prefix_id is null, got {plen[row]}")
        if "prompt_ids" in token_ids:
            group = np.asarray(pc.dictionary_encode(pid).indices.fill_null(-1))
            _check_shared_prefix(group, plen, token_ids["prompt_ids"], w)
        out["prefix_id"] = pid
        out["prefix_len"] = pa.array(plen.astype(np.int32), type=pa.int32())
    return pa.table(out).replace_schema_metadata(table.schema.metadata)


# ---- conversion, files --------------------------------------------------------------------------
def _metadata(schema: pa.Schema) -> dict[str, str]:
    raw = schema.metadata or {}
    out = {}
    for k, v in raw.items():
        key = k.decode("utf-8", "replace")
        if key.startswith("ARROW:") or key == "pandas":
            continue
        out[key] = v.decode("utf-8", "replace")
    return out


def _np(arr: pa.Array) -> np.ndarray:
    if _kind(arr.type) == "string":
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=object)
    return np.asarray(arr)


def from_table(canonical: pa.Table) -> Trace:
    """A Trace from a table that `validate` returned."""
    c = {name: canonical.column(name).combine_chunks() for name in canonical.column_names}

    def tokens(name: str) -> TokenLists | None:
        if name not in c:
            return None
        lens = np.asarray(pc.list_value_length(c[name])).astype(np.int64)
        offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        return TokenLists(np.asarray(c[name].flatten()).astype(np.int32), offsets)

    group = keys = plen = None
    if "prefix_id" in c:
        enc = pc.dictionary_encode(c["prefix_id"])
        group = np.asarray(enc.indices.fill_null(-1)).astype(np.int32)
        keys = _np(enc.dictionary)
        plen = np.asarray(c["prefix_len"])
    return Trace(
        request_id=_np(c["request_id"]),
        arrival_s=np.asarray(c["arrival_s"]),
        prompt_len=np.asarray(c["prompt_len"]),
        output_len=np.asarray(c["output_len"]),
        prompt_ids=tokens("prompt_ids"),
        output_ids=tokens("output_ids"),
        accept_rate=np.asarray(c["accept_rate"]) if "accept_rate" in c else None,
        needs_history=np.asarray(c["needs_history"]) if "needs_history" in c else None,
        prefix_group=group,
        prefix_keys=keys,
        prefix_len=plen,
        metadata=_metadata(canonical.schema),
    )


def read_trace(path: str | Path, model: ModelSpec | None = None) -> Trace:
    """Read and validate a trace file (against `model`'s context and vocab when given)."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace '{p}': no such file")
    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as e:
        raise TraceError(f"trace '{p}': not a readable parquet file ({e})") from None
    return from_table(validate(table, model, name=str(p)))


def write_trace(trace: Trace, path: str | Path, model: ModelSpec | None = None) -> Path:
    """Validate, then write whole or not at all (bubblesim.core.atomic.replacing), zstd."""
    p = Path(path)
    table = validate(trace.to_table(), model, name=str(p))
    p.parent.mkdir(parents=True, exist_ok=True)
    with replacing(p) as tmp:
        pq.write_table(table, tmp, compression="zstd", compression_level=9)
    return p


def trace_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def make_trace(arrival_s: Any, prompt_len: Any, output_len: Any, **columns: Any) -> Trace:
    """A Trace from plain arrays, request ids 0..n-1 unless given (for generators and tests)."""
    arrival = np.asarray(arrival_s, dtype=np.float64)
    rid = columns.pop("request_id", None)
    return Trace(
        request_id=np.arange(len(arrival), dtype=np.int64) if rid is None else np.asarray(rid),
        arrival_s=arrival,
        prompt_len=np.asarray(prompt_len, dtype=np.int32),
        output_len=np.asarray(output_len, dtype=np.int32),
        **columns,
    )
