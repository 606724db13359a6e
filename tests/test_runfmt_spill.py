"""A long run's step records spilled to disk as it goes (RunRecorder(spill_dir=...)) and
steps.parquet written a row group at a time (codec.write_chunks): the same values, bit for bit,
as the in-memory recorder and the one-shot write; nothing left behind."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sim.run as run
from bubblesim.core.config import load_config
from bubblesim.core.runfmt import RunRecorder, codec, load_run, trace_info, write_run
from bubblesim.core.runfmt.bubbles import account_bubbles
from bubblesim.core.runfmt.recording import Recording
from bubblesim.core.runfmt.spill import StepSpill, release
from bubblesim.core.runfmt.tables import steps_table
from bubblesim.core.trace import make_trace, write_trace

SETS = ["model=llama3-8b", "num_kv_blocks=150", "max_num_seqs=24"]  # preemptions, fast path


def _trace(path: Path, n: int = 120) -> Path:
    i = np.arange(n)
    return write_trace(make_trace(i * 0.03, 60 + (i * 37) % 500, 20 + (i * 53) % 200), path)


def _same(x: object, y: object) -> bool:
    if isinstance(x, np.ndarray):
        assert isinstance(y, np.ndarray)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.dtype.kind == "f":
            return bool(np.array_equal(x.view(np.int64), np.asarray(y).view(np.int64)))
        return bool(np.array_equal(x, y))
    return x == y


def _recordings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Recording, Recording]:
    """One sim run recorded in memory and spilled (small chunks: many spills, lag 5 steps)."""
    trace = _trace(tmp_path / "t.parquet")
    cfg = load_config(None, SETS)
    plain = run.simulate(cfg, trace).recorder.freeze()
    spill = tmp_path / "spill"
    spill.mkdir()

    def spilling(**kw: object) -> RunRecorder:
        return RunRecorder(spill_dir=spill, chunk_steps=64, spill_lag=5)

    monkeypatch.setattr(run, "RunRecorder", spilling)
    spilled = run.simulate(cfg, trace).recorder.freeze()
    assert len(list(spill.glob("*.bin"))) == 6 and len(list(spill.glob("*.block"))) == 3
    return plain, spilled


def test_spilled_recording_is_the_in_memory_one(tmp_path, monkeypatch):
    plain, spilled = _recordings(tmp_path, monkeypatch)
    assert plain.num_steps > 500 and plain.sync_step.size > 0
    assert isinstance(spilled.phase_start, np.memmap) and spilled.phase_start.flags.f_contiguous
    for f in fields(Recording):
        assert _same(getattr(plain, f.name), getattr(spilled, f.name)), f.name
    release(spilled.phase_start, spilled.shape)  # pages dropped: the values read back the same
    assert _same(plain.phase_start, spilled.phase_start)


def test_recording_into_a_spilled_step_is_refused(tmp_path):
    rec = RunRecorder(spill_dir=tmp_path, chunk_steps=8, spill_lag=2)
    from bubblesim.core.shape import BatchShape

    for _ in range(40):
        rec.add_step(BatchShape())
    with pytest.raises(IndexError, match="already written to the spill folder"):
        rec.gpu(0, 0.0, 1.0)
    rec.gpu(39, 0.0, 1.0)  # recent steps are still in memory
    with pytest.raises(IndexError, match="step 40 was not added"):
        rec.gpu(40, 0.0, 1.0)


def test_spill_columns_and_blocks(tmp_path):
    sp = StepSpill(tmp_path)
    sp.append("a", np.arange(3.0))
    sp.append("a", np.arange(3.0, 5.0))
    sp.append("b", -np.arange(5.0))
    with pytest.raises(TypeError):
        sp.append("a", np.arange(2))
    sp.close()
    assert _same(np.asarray(sp.column("a", np.float64, 5)), np.arange(5.0))
    with pytest.raises(ValueError, match="holds 5 rows, 6 asked"):
        sp.column("a", np.float64, 6)
    block = sp.block("ab", ["a", "b"], np.float64, 4)
    assert block.shape == (4, 2) and block.flags.f_contiguous
    assert _same(np.asarray(block[:, 1]), -np.arange(4.0))
    assert sp.block("none", [], np.float64, 0).shape == (0, 0)
    with pytest.raises(ValueError, match="joined into a block and deleted"):
        sp.column("b", np.float64, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ab.block", "none.block"]


def _roundtrip(table: pa.Table, path: Path, rows: int | None) -> pa.Table:
    codec.write_chunks(path, table.num_rows, lambda lo, hi: table.slice(lo, hi - lo), rows)
    return codec.read_table(path)


@pytest.mark.parametrize("group", [7, 64, 1000])
def test_chunked_steps_table_reads_back_bit_for_bit(tmp_path, monkeypatch, group):
    plain, _ = _recordings(tmp_path, monkeypatch)
    bub = account_bubbles(plain)
    whole = steps_table(plain, bub)
    pieces = [steps_table(plain, bub, lo, lo + group) for lo in range(0, plain.num_steps, group)]
    assert pa.concat_tables(pieces).equals(whole)  # rows alone = rows of the whole table
    one = tmp_path / "one.parquet"
    codec.write_table(whole, one)
    back = _roundtrip(whole, tmp_path / "chunked.parquet", group)
    assert pq.read_metadata(tmp_path / "chunked.parquet").num_row_groups == math.ceil(
        whole.num_rows / group
    )
    for name in whole.column_names:
        a, b = whole.column(name).to_numpy(), back.column(name).to_numpy()
        assert _same(a, b), name
    assert back.equals(codec.read_table(one))


def test_chunked_nanosecond_columns_carry_across_row_groups(tmp_path):
    """A measured run's clock readings (whole nanoseconds, NaN rows) and ints past int32 in a
    later row group only: every value back, every column's type as one write gives it."""
    n = 5000
    rng = np.random.default_rng(0)
    t = np.cumsum(rng.integers(1, 10**6, n)) / 1e9
    t[rng.random(n) < 0.2] = np.nan
    t[:40] = np.nan  # a first row group of NaN only
    big = np.arange(n, dtype=np.int64)
    big[-1] = 1 << 40
    table = pa.table({"t": t, "u": t + 0.5, "i": big, "s": pa.array(["x", "y"] * (n // 2))})
    back = _roundtrip(table, tmp_path / "c.parquet", 40)
    for name in table.column_names:
        a, b = table.column(name), back.column(name)
        assert a.type == b.type and _same(a.to_numpy(), b.to_numpy()), name
    enc = pq.read_schema(tmp_path / "c.parquet")
    assert enc.field("t").metadata[codec.NS_KEY] == b"1" and enc.field("i").type == pa.int64()
    one = tmp_path / "one.parquet"
    codec.write_table(table, one)
    assert pq.read_schema(one).field("t").metadata[codec.NS_KEY] == b"1"
    # one row group: byte for byte what write_table writes
    _roundtrip(table, tmp_path / "same.parquet", n)
    assert (tmp_path / "same.parquet").read_bytes() == one.read_bytes()


def test_sim_run_folder_in_row_groups_has_the_same_values(tmp_path, monkeypatch):
    """simulate's folder (spilled records, steps in row groups of 50) against write_run of the
    same run recorded in memory."""
    trace = _trace(tmp_path / "t.parquet")
    cfg = load_config(None, SETS)
    res = run.simulate(cfg, trace)
    rec = res.recorder.freeze()
    ref = tmp_path / "ref"
    write_run(ref, rec, config=cfg, trace=trace_info(trace), source={"kind": "sim"})
    monkeypatch.setattr(codec, "ROW_GROUP_ROWS", 50)
    out = tmp_path / "out"
    run.simulate(cfg, trace, out)
    a, b = load_run(ref), load_run(out)
    assert pq.read_metadata(out / "steps.parquet").num_row_groups > 10
    for table in ("requests", "steps", "gc"):
        x, y = a.arrays(table), b.arrays(table)
        assert list(x) == list(y)
        for name in x:
            assert _same(x[name], y[name]), (table, name)
    keep = {"sim", "overload", "trace"}
    assert {k: v for k, v in a.summary.items() if k not in keep} == {
        k: v for k, v in b.summary.items() if k not in keep
    }
    assert (ref / "timeline.json").read_text() == (out / "timeline.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref", "t.parquet"]


def test_failed_run_leaves_no_spill_folder(tmp_path):
    trace = _trace(tmp_path / "t.parquet")
    cfg = load_config(None, SETS)

    def broken(*a: object, **kw: object) -> None:
        raise RuntimeError("disk full")

    out = tmp_path / "runs" / "r"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run, "write_run", broken)
        with pytest.raises(RuntimeError, match="disk full"):
            run.simulate(cfg, trace, out)
    assert list((tmp_path / "runs").iterdir()) == []


def test_bubbles_from_the_activities_near_the_gaps_are_the_whole_runs(tmp_path, monkeypatch):
    """account_bubbles keeps only the CPU activities that overlap a gap with bubble; against
    every activity (the former way), on a CPU-bound run with bubbles of every cause."""
    from bubblesim.core.phases import CPU_PHASES, GC, SYNC
    from bubblesim.core.runfmt import bubbles
    from bubblesim.core.runfmt.intervals import SortedIntervals

    trace = _trace(tmp_path / "t.parquet", 200)
    sets = ["model=tiny", "max_num_batched_tokens=256", "gc_freeze=false"]
    rec = run.simulate(load_config(None, sets), trace).recorder.freeze()
    now = account_bubbles(rec, chunk_gaps=16)

    def every(r: Recording, gap_s: np.ndarray, gap_e: np.ndarray) -> dict:
        acts = {
            j: SortedIntervals.of(r.phase_start[:, j], r.phase_end[:, j])
            for j in range(len(CPU_PHASES))
        }
        acts[bubbles.CAUSES.index(SYNC)] = SortedIntervals.of(r.sync_start, r.sync_end)
        acts[bubbles.CAUSES.index(GC)] = SortedIntervals.of(r.gc_start, r.gc_start + r.gc_dur)
        return acts

    monkeypatch.setattr(bubbles, "_activities", every)
    before = account_bubbles(rec, chunk_gaps=16)
    assert now.bubble_s > 0 and sum(v > 0 for v in now.by_cause.values()) >= 3
    for f in fields(before):
        assert _same(getattr(before, f.name), getattr(now, f.name)), f.name


def test_chunked_write_error_propagates(tmp_path, monkeypatch):
    """A row group that fails to write (in the writer thread) fails the write, file closed."""
    n = 300
    table = pa.table({"t": np.arange(n) * 0.1, "i": np.arange(n)})
    calls = []
    real = pq.ParquetWriter.write_table

    def failing(self: pq.ParquetWriter, *a: object, **kw: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        real(self, *a, **kw)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", failing)
    with pytest.raises(OSError, match="disk full"):
        _roundtrip(table, tmp_path / "c.parquet", 100)
    assert len(calls) == 2


def test_count_upto_is_searchsorted():
    """measure_upto's lookup for ascending points (a run's gaps): the same counts."""
    from bubblesim.core.runfmt.intervals import _count_upto

    rng = np.random.default_rng(1)
    for trial in range(300):
        n, m = int(rng.integers(0, 50)), int(rng.integers(0, 200))
        starts = np.sort(rng.choice(np.arange(100.0), n))
        x = np.sort(rng.choice(np.arange(-5.0, 105.0, 0.5), m))
        if trial % 3 == 0:
            x = np.sort(np.concatenate((x, starts[: m // 3])))  # points on the starts
        if trial % 5 == 0:
            x = x[::-1].copy()  # not ascending: the plain lookup
        assert np.array_equal(_count_upto(starts, x), np.searchsorted(starts, x, side="right"))


def test_chunked_plan_guess_missed_is_rewritten(tmp_path):
    """Decisions guessed on the first row group and the sample rows (nanoseconds, int32) that a
    later row group breaks: the file is written again, decided on every row."""
    n = 5000
    sampled = np.zeros(n, bool)
    for s in codec._sample_starts(n):
        sampled[s : s + 129] = True
    row = int(np.flatnonzero(~sampled[100:])[0]) + 100  # neither first group nor sample
    t = np.arange(n) / 1e9  # whole nanoseconds...
    t[row] = 0.1234567891234  # ...but one
    big = np.arange(n, dtype=np.int64)
    big[row] = 1 << 40
    table = pa.table({"t": t, "i": big})
    back = _roundtrip(table, tmp_path / "c.parquet", 100)
    for name in table.column_names:
        assert _same(table.column(name).to_numpy(), back.column(name).to_numpy()), name
    schema = pq.read_schema(tmp_path / "c.parquet")
    assert codec.NS_KEY not in schema.field("t").metadata and schema.field("i").type == pa.int64()
