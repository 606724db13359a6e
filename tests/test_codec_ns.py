"""The codec's nanosecond columns (bubblesim.core.runfmt.codec, NS_KEY): a measured run's clock
readings (`ns / 1e9`) come back bit for bit, NaN rows included, at a fraction of the bits'
size; a column with any other value (-0.0, a non-canonical NaN, a value that is not a whole
nanosecond, inf) stays in the bit-pattern form."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bubblesim.core.runfmt import codec


def clock_ns(n: int, seed: int = 0) -> np.ndarray:
    """Nanoseconds since a start: steps of 0.3-3 ms."""
    return np.cumsum(np.random.default_rng(seed).integers(300_000, 3_000_000, n))


def clock(n: int, seed: int = 0) -> np.ndarray:
    """Seconds since a start, read from a nanosecond clock as replay.gpu.measure does."""
    return clock_ns(n, seed) / 1e9


def roundtrip(tmp_path: Path, table: pa.Table) -> tuple[pa.Table, pa.Schema]:
    path = tmp_path / "t.parquet"
    codec.write_table(table, path)
    return codec.read_table(path), pq.read_schema(path)


def same_bits(a: pa.Table, b: pa.Table) -> bool:
    return a.schema.equals(b.schema, check_metadata=True) and all(
        np.array_equal(a.column(c).to_numpy().view(np.int64), b.column(c).to_numpy().view(np.int64))
        for c in a.column_names
    )


def test_clock_readings_with_nan_rows_come_back_bit_for_bit(tmp_path: Path) -> None:
    start_ns = clock_ns(5000)
    start = start_ns / 1e9
    end = (start_ns + np.random.default_rng(1).integers(1_000, 90_000, 5000)) / 1e9
    wait = end.copy()
    wait[::7] = np.nan  # rows without the activity
    wait[0] = np.nan  # a NaN first row: no previous value to hold
    t = pa.table({"start_s": start, "end_s": end, "wait_s": wait})
    back, stored = roundtrip(tmp_path, t)
    assert same_bits(back, t)
    ns = {f.name for f in stored if (f.metadata or {}).get(codec.NS_KEY) == b"1"}
    assert ns == {"start_s", "end_s", "wait_s"}
    assert codec.NAN_PREFIX + "wait_s" in stored.names
    assert codec.NAN_PREFIX + "wait_s" not in back.column_names


def test_nanoseconds_take_less_room_than_bit_patterns(tmp_path: Path) -> None:
    a, b = clock(20_000), clock(20_000, seed=3)
    codec.write_table(pa.table({"a_s": a, "b_s": b}), tmp_path / "ns.parquet")
    bits_only = pa.table({"a_s": a + 1e-13, "b_s": b + 1e-13})
    codec.write_table(bits_only, tmp_path / "bits.parquet")  # not whole nanoseconds any more
    assert not any(
        codec.NS_KEY in (f.metadata or {}) for f in pq.read_schema(tmp_path / "bits.parquet")
    )
    assert (tmp_path / "ns.parquet").stat().st_size < 0.7 * (
        tmp_path / "bits.parquet"
    ).stat().st_size


def test_other_values_keep_the_bit_form(tmp_path: Path) -> None:
    odd_nan = np.array([0x7FF8000000000001], dtype=np.int64).view(np.float64)[0]
    for bad in (-0.0, odd_nan, np.inf, 0.1 + 1e-12):
        v = clock(100)
        v[50] = bad
        t = pa.table({"x_s": v})
        back, stored = roundtrip(tmp_path, t)
        assert same_bits(back, t), bad
        assert codec.NS_KEY not in (stored.field("x_s").metadata or {}), bad


def test_a_nanosecond_column_without_its_nan_marks_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    codec.write_table(pa.table({"x_s": clock(10)}), path)
    stored = pq.read_table(path)
    broken = stored.drop_columns([codec.NAN_PREFIX + "x_s"])
    try:
        codec.decode(broken)
    except codec.CodecError as e:
        assert "stored as nanoseconds without" in str(e)
    else:
        raise AssertionError("decoded without the NaN column")


def test_version_1_tables_still_read(tmp_path: Path) -> None:
    t = pa.table({"x_s": clock(50)})
    enc = codec.encode(t)
    meta = {**enc.schema.metadata, codec.CODEC_KEY: b"1"}
    v1 = enc.replace_schema_metadata(meta)
    assert codec.decode(v1).column("x_s").to_numpy().size == 50  # version 1 readers' layout
