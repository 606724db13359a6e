"""Synthetic `replay shapes` sweep files for the report tests: each batch timed at a given ms,
written as a llama3-8b sweep on an H100 (what the reports' fits read)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from replay.analysis.shapes_file import FORMAT_VERSION, Sample, shape_row, write_sweep
from replay.analysis.shapes_grid import MIX_FAMILIES, Batch, Limits, batch_shape, grid

H100 = "NVIDIA H100 80GB HBM3"
META = {"format": "replay.shapes", "version": FORMAT_VERSION, "model": "llama3-8b", "gpu": H100,
        "dtype": "bfloat16"}  # fmt: skip


def mix_batches(lim: Limits) -> Iterator[tuple[Batch, dict[str, Any]]]:
    """The grid's decode(mix) batches (both orders) under `lim`, each with its batch shape."""
    for b in grid(lim, ("decode",), mix=True):
        if b.label in MIX_FAMILIES:
            yield b, batch_shape(b.entries)


def write_timed(path: Path, timed: Iterable[tuple[Batch, float]]) -> Path:
    """A sweep file of decode batches, each timed at its ms (a row's bucket: its batch's rows)."""
    rows = [
        shape_row(b, [Sample(ms, 0.1, 0.2)], 0, len(b.entries), b.max_seq_len, 1, False)
        for b, ms in timed
    ]
    return write_sweep(path, rows, dict(META))
