"""Property-based fuzzing of the trace validator: on any table it either accepts (and what it
accepts round-trips) or raises TraceError with one line; never any other exception."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bubblesim.core.models import PRESETS
from bubblesim.core.trace import COLUMNS, TraceError, from_table, validate, write_trace

INT_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32(), pa.uint64()]
FLOAT_TYPES = [pa.float16(), pa.float32(), pa.float64()]
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ints_for(t: pa.DataType) -> st.SearchStrategy[int]:
    bits = t.bit_width
    lo, hi = (
        (0, 2**bits - 1)
        if pa.types.is_unsigned_integer(t)
        else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    )
    return st.integers(lo, hi) | st.integers(max(lo, -3), min(hi, 600))  # mostly small values


@st.composite
def column(draw: st.DrawFn, n: int) -> pa.Array:
    kind = draw(st.sampled_from(["int", "float", "str", "bool", "list", "list_str", "null"]))
    nulls = draw(st.booleans())

    def maybe_null(x: st.SearchStrategy) -> st.SearchStrategy:
        return st.none() | x if nulls else x

    if kind == "int":
        t = draw(st.sampled_from(INT_TYPES))
        return pa.array(draw(st.lists(maybe_null(_ints_for(t)), min_size=n, max_size=n)), t)
    if kind == "float":
        t = draw(st.sampled_from(FLOAT_TYPES))
        vals = draw(
            st.lists(
                st.floats(allow_nan=True, allow_infinity=True, width=16), min_size=n, max_size=n
            )
        )
        return pa.array(np.array(vals, dtype=t.to_pandas_dtype()))
    if kind == "str":
        return pa.array(draw(st.lists(maybe_null(st.text(max_size=3)), min_size=n, max_size=n)))
    if kind == "bool":
        return pa.array(draw(st.lists(maybe_null(st.booleans()), min_size=n, max_size=n)))
    if kind == "list":
        t = draw(st.sampled_from(INT_TYPES))
        inner = st.lists(maybe_null(_ints_for(t)), max_size=4)
        lt = draw(st.sampled_from([pa.list_(t), pa.large_list(t)]))
        return pa.array(draw(st.lists(maybe_null(inner), min_size=n, max_size=n)), lt)
    if kind == "list_str":
        return pa.array(
            draw(st.lists(st.lists(st.text(max_size=2), max_size=2), min_size=n, max_size=n))
        )
    return pa.nulls(n)


@st.composite
def wild_tables(draw: st.DrawFn) -> pa.Table:
    """Any mix of known and unknown columns of any type."""
    n = draw(st.integers(0, 5))
    names = draw(
        st.lists(st.sampled_from([*COLUMNS, "junk"]), max_size=len(COLUMNS) + 1, unique=True)
    )
    required = draw(st.booleans())
    if required:
        names = list(dict.fromkeys(["request_id", "arrival_s", "prompt_len", "output_len", *names]))
    return pa.table({name: draw(column(n)) for name in names})


@st.composite
def near_valid_tables(draw: st.DrawFn) -> pa.Table:
    """A valid table with every column, then one cell or one column's type changed."""
    n = draw(st.integers(1, 5))
    plen = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    olen = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    shared = [5, 5, 5, 5, 5, 5]
    has_prefix = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    prefix_len = [draw(st.integers(0, p)) if h else 0 for p, h in zip(plen, has_prefix)]
    cols: dict[str, pa.Array] = {
        "request_id": pa.array(list(range(n))),
        "arrival_s": pa.array(draw(st.lists(st.floats(0, 100), min_size=n, max_size=n))),
        "prompt_len": pa.array(plen, pa.int32()),
        "output_len": pa.array(olen, pa.int32()),
        "prompt_ids": pa.array([shared[:p] for p in plen], pa.list_(pa.int32())),
        "output_ids": pa.array([[1] * o for o in olen], pa.list_(pa.int32())),
        "accept_rate": pa.array(
            draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)), pa.float32()
        ),
        "needs_history": pa.array(draw(st.lists(st.booleans(), min_size=n, max_size=n))),
        "prefix_id": pa.array([7 if h else None for h in has_prefix], pa.int64()),
        "prefix_len": pa.array(prefix_len, pa.int32()),
    }
    victim = draw(st.sampled_from([*COLUMNS, None]))
    if victim is not None:
        how = draw(st.sampled_from(["cell", "column", "drop"]))
        if how == "drop":
            del cols[victim]
        elif how == "column":
            cols[victim] = draw(column(n))
        else:
            values = cols[victim].to_pylist()
            i = draw(st.integers(0, n - 1))
            values[i] = draw(
                st.none()
                | st.integers(-(2**63), 2**63 - 1)
                | st.integers(-2, 600)
                | st.floats()
                | st.lists(st.integers(-2, 600), max_size=7)
            )
            try:
                cols[victim] = pa.array(values, cols[victim].type)
            except (pa.ArrowException, TypeError, OverflowError):
                cols[victim] = pa.array(values) if _uniform(values) else cols[victim]
    return pa.table(cols)


def _uniform(values: list) -> bool:
    try:
        pa.array(values)
        return True
    except (pa.ArrowException, TypeError, OverflowError):
        return False


def _check(table: pa.Table, model: bool) -> pa.Table | None:
    try:
        out = validate(table, PRESETS["tiny"] if model else None, name="fuzz.parquet")
    except TraceError as e:
        msg = str(e)
        assert msg.startswith("trace 'fuzz.parquet'") and "\n" not in msg, msg
        return None
    return out


@SETTINGS
@given(wild_tables(), st.booleans())
@pytest.mark.slow
def test_wild_tables_accept_or_trace_error(table: pa.Table, model: bool) -> None:
    _check(table, model)


@SETTINGS
@given(near_valid_tables(), st.booleans())
def test_near_valid_tables_accept_or_trace_error(table: pa.Table, model: bool) -> None:
    out = _check(table, model)
    if out is not None:  # anything accepted converts, and survives a write/read unchanged
        trace = from_table(out)
        assert len(trace) == table.num_rows
        assert (trace.prompt_len >= 1).all() and (trace.output_len >= 1).all()
        assert np.isfinite(trace.arrival_s).all() and (trace.arrival_s >= 0).all()


@pytest.fixture(scope="module")
def outdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=60, deadline=None)
@given(near_valid_tables())
def test_accepted_tables_round_trip(outdir: Path, table: pa.Table) -> None:
    from bubblesim.core.trace import read_trace

    out = _check(table, False)
    if out is None:
        return
    path = write_trace(from_table(out), outdir / "rt.parquet")
    again = read_trace(path)
    assert (
        again.to_table()
        .select(out.column_names)
        .equals(from_table(out).to_table().select(out.column_names))
    )
