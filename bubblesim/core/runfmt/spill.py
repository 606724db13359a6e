"""Step columns on disk while a long run records (`RunRecorder(spill_dir=...)`), read back as
read-only memory maps.

A run of millions of steps holds ~216 bytes a step in its step columns (1.9 GB for the 1M-request
day): the recorder appends each finished chunk of a column to its own raw file here (native
byte order, the column's dtype) and keeps only the recent steps in memory. `freeze` joins the
columns of a 2-D field (shape, phase starts, phase ends) into one column-major file and maps it,
so a `Recording` built from a spill has the same arrays, values and layout as one built in memory.

Pages of a map that were read stay in the process's resident set until the map is dropped or
`release`d: a consumer that reads a big map column by column calls `release` after each, so the
peak stays one column (the data stays in the page cache; reading it again maps it back in).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

_COPY_BYTES = 1 << 30  # one copy_file_range call at most (the kernel may copy less)


class StepSpill:
    """Append-only raw column files in `folder` (which the caller creates and removes)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._files: dict[str, object] = {}
        self._rows: dict[str, int] = {}
        self._dtype: dict[str, np.dtype] = {}

    def append(self, name: str, values: np.ndarray) -> None:
        """Add `values` (1-D) to the end of column `name`."""
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.folder / f"{name}.bin", "wb")  # noqa: SIM115
            self._rows[name] = 0
            self._dtype[name] = values.dtype
        elif values.dtype != self._dtype[name]:
            raise TypeError(f"spill column {name!r}: {values.dtype}, was {self._dtype[name]}")
        f.write(np.ascontiguousarray(values).data)  # type: ignore[attr-defined]
        self._rows[name] += len(values)

    def rows(self, name: str) -> int:
        return self._rows.get(name, 0)

    def close(self) -> None:
        for f in self._files.values():
            f.close()  # type: ignore[attr-defined]

    def column(self, name: str, dtype: type, n: int) -> np.ndarray:
        """Column `name` (its first n rows; empty if never appended) as a read-only map."""
        self._check(name, n)
        return _map(self.folder / f"{name}.bin", np.dtype(dtype), (n,))

    def block(self, out: str, names: list[str], dtype: type, n: int) -> np.ndarray:
        """Columns `names` side by side as an (n, len(names)) column-major read-only map, the
        files joined on disk: a first column of exactly n rows becomes the block (renamed), the
        others are appended (copy_file_range: no copy passes through this process); each
        column's own file is gone once joined (the disk holds the run about once)."""
        path = self.folder / f"{out}.block"
        item = np.dtype(dtype).itemsize
        for name in names:
            self._check(name, n)
        rest = names
        if names and n and self.rows(names[0]) == n:  # nothing past n rows: keep its file
            (self.folder / f"{names[0]}.bin").replace(path)
            self._rows[names[0]], rest = -1, names[1:]
        with open(path, "r+b" if rest is not names else "wb") as dst:
            dst.seek(0, os.SEEK_END)  # copy_file_range refuses a file opened to append
            for name in rest:
                col = self.folder / f"{name}.bin"
                if n:
                    with open(col, "rb") as src:
                        _copy(src.fileno(), dst.fileno(), n * item)
                col.unlink(missing_ok=True)
                self._rows[name] = -1  # gone: column() and block() refuse it
        return _map(path, np.dtype(dtype), (n, len(names)))

    def _check(self, name: str, n: int) -> None:
        f = self._files.get(name)
        if f is not None and not f.closed:  # type: ignore[attr-defined]
            f.flush()  # type: ignore[attr-defined]
        if self.rows(name) < 0:
            raise ValueError(f"spill column {name!r} was joined into a block and deleted")
        if self.rows(name) < n:
            raise ValueError(f"spill column {name!r} holds {self.rows(name)} rows, {n} asked")


def _copy(src: int, dst: int, nbytes: int) -> None:
    left = nbytes
    while left:
        done = os.copy_file_range(src, dst, min(left, _COPY_BYTES))
        if done <= 0:
            raise OSError(f"copy_file_range copied {done} bytes with {left} to go")
        left -= done


def _map(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype, order="F")
    return np.memmap(path, dtype=dtype, mode="r", shape=shape, order="F")


def release(*arrays: object) -> None:
    """Drop from the resident set the pages of each array that maps a spill file (the whole
    map); no-op for any other array. Later reads map them back in from the page cache."""
    for a in arrays:
        mm = getattr(a, "_mmap", None)
        if isinstance(mm, mmap.mmap) and not mm.closed:
            mm.madvise(mmap.MADV_DONTNEED)
