"""StepSpill.block: the columns joined into one column-major map, whether the first column's
file becomes the block (it holds exactly the rows asked) or every column is copied."""

from __future__ import annotations

import numpy as np
import pytest

from bubblesim.core.runfmt.spill import StepSpill


def _spill(tmp_path, rows: int) -> StepSpill:
    sp = StepSpill(tmp_path)
    for k in range(0, rows, 3):  # appended in chunks, as a recorder does
        stop = min(rows, k + 3)
        sp.append("a", np.arange(k, stop, dtype=np.int64))
        sp.append("b", -np.arange(k, stop, dtype=np.int64))
        sp.append("c", 100 + np.arange(k, stop, dtype=np.int64))
    sp.close()
    return sp


@pytest.mark.parametrize("n", [7, 5])  # 7: the first file is the block; 5: all copied
def test_block_joins_columns_column_major(tmp_path, n):
    sp = _spill(tmp_path, 7)
    first = sp.column("a", np.int64, n)  # a map taken before the join reads the same after
    block = sp.block("abc", ["a", "b", "c"], np.int64, n)
    assert block.shape == (n, 3) and block.flags.f_contiguous
    want = np.column_stack((np.arange(n), -np.arange(n), 100 + np.arange(n)))
    assert np.array_equal(block, want)
    assert np.array_equal(first, np.arange(n))
    assert [p.name for p in tmp_path.iterdir()] == ["abc.block"]
    for name in ("a", "b", "c"):
        with pytest.raises(ValueError, match="joined into a block and deleted"):
            sp.column(name, np.int64, 1)


def test_block_refuses_short_column_and_leaves_files(tmp_path):
    sp = _spill(tmp_path, 4)
    with pytest.raises(ValueError, match="holds 4 rows, 5 asked"):
        sp.block("abc", ["a", "b", "c"], np.int64, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin", "c.bin"]
    assert np.array_equal(sp.block("abc", ["a", "b", "c"], np.int64, 0), np.zeros((0, 3)))
