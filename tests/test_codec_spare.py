"""codec.write_chunks hands a written row group's encoded columns to the row group after next
(`_Spare`): the file is the one written with new arrays for every row group, byte for byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from bubblesim.core.runfmt import codec


def _table(n: int) -> pa.Table:
    rng = np.random.default_rng(3)
    t = np.cumsum(rng.exponential(1e-3, n))
    return pa.table(
        {
            "step": np.arange(n, dtype=np.int64),
            "a_start_s": t,
            "a_end_s": t + rng.exponential(1e-4, n),  # refs a_start_s, its differences
            "b_s": np.where(rng.random(n) < 0.1, np.nan, rng.random(n)),  # alone
            "count": rng.integers(0, 9, n),  # int32
            "big": rng.integers(-(2**40), 2**40, n),  # int64
        }
    )


def _write(table: pa.Table, path: Path, group: int) -> bytes:
    codec.write_chunks(path, table.num_rows, lambda lo, hi: table.slice(lo, hi - lo), group)
    return path.read_bytes()


@pytest.mark.parametrize("group", [1000, 997, 2500])
def test_recycled_columns_write_the_same_bytes(tmp_path, monkeypatch, group):
    table = _table(10_000)
    lent: list[bool] = []
    taken = codec._Spare.empty

    def counted(self, n, dtype):  # type: ignore[no-untyped-def]
        fresh = not self.free.get((n, np.dtype(dtype).str))
        lent.append(fresh)
        return taken(self, n, dtype)

    monkeypatch.setattr(codec._Spare, "empty", counted)
    recycled = _write(table, tmp_path / "recycled.parquet", group)
    assert not all(lent)  # some row group took an earlier one's columns
    monkeypatch.setattr(codec._Spare, "give_back", lambda self: None)
    fresh = _write(table, tmp_path / "fresh.parquet", group)
    assert recycled == fresh
    back = codec.read_table(tmp_path / "recycled.parquet")
    for name in table.column_names:
        a, b = table.column(name).to_numpy(), back.column(name).to_numpy()
        assert np.array_equal(a.view(np.int64), b.view(np.int64))
