"""`sim.run.RequestRows`: a lengths-only trace's requests made as the loop reaches them give the
same run as the full list `build_requests` makes, and the same refusal of a request that can
never fit."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

import sim.run as run
from bubblesim.core.config import load_config
from bubblesim.core.runfmt.recording import Recording
from bubblesim.core.trace import TraceError, make_trace, read_trace, write_trace


def _trace(path: Path, output: np.ndarray | None = None) -> Path:
    i = np.arange(150)
    out = 20 + (i * 53) % 200 if output is None else output
    ids = np.array([f"r{k}" for k in (i * 7) % 150])  # string ids, arrivals out of row order
    arrival = (i * 37 % 150) * 0.02
    return write_trace(make_trace(arrival, 60 + (i * 37) % 500, out, request_id=ids), path)


def _frozen(trace: Path, sets: list[str]) -> Recording:
    return run.simulate(load_config(None, sets), trace).recorder.freeze()


@pytest.mark.parametrize(
    "sets",
    [["model=llama3-8b"], ["model=llama3-8b", "num_kv_blocks=150", "arrival=asap"]],
)
def test_request_rows_run_is_the_list_run(tmp_path, monkeypatch, sets):
    trace = _trace(tmp_path / "t.parquet")
    assert run.RequestRows.fits(read_trace(trace))
    lazy = _frozen(trace, sets)
    monkeypatch.setattr(run.RequestRows, "fits", staticmethod(lambda t: False))
    listed = _frozen(trace, sets)
    for f in fields(Recording):
        a, b = getattr(lazy, f.name), getattr(listed, f.name)
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            assert np.array_equal(a.view(np.int64), b.view(np.int64)), f.name
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b), f.name
        else:
            assert a == b, f.name


def test_request_rows_are_build_requests(tmp_path):
    t = read_trace(_trace(tmp_path / "t.parquet"))
    rows, listed = run.RequestRows(t), run.build_requests(t)
    assert len(rows) == len(listed)
    for k in (0, 1, 77, len(listed) - 1, -1):
        a, b = rows[k], listed[k]
        assert [getattr(a, s) for s in a.__slots__ if hasattr(a, s)] == [
            getattr(b, s) for s in b.__slots__ if hasattr(b, s)
        ]
    assert rows[5] is rows[5]  # the loop peeks, then submits the same object
    with pytest.raises(IndexError):
        rows[len(listed)]


def test_unfit_request_refused_as_the_list_does(tmp_path, monkeypatch):
    out = np.full(150, 30)
    out[[40, 90]] = 2000  # more KV blocks than the cache: the first in arrival order is named
    trace = _trace(tmp_path / "t.parquet", out)
    cfg = load_config(None, ["model=llama3-8b", "num_kv_blocks=40"])
    with pytest.raises(TraceError) as lazy:
        run.simulate(cfg, trace)
    monkeypatch.setattr(run.RequestRows, "fits", staticmethod(lambda t: False))
    with pytest.raises(TraceError) as listed:
        run.simulate(cfg, trace)
    assert str(lazy.value) == str(listed.value)
    assert "request 'r" in str(lazy.value) and "KV blocks" in str(lazy.value)
