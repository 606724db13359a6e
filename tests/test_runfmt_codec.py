"""Run folder encoding (bubblesim.core.runfmt.codec, format version 2): lossless round trip of every
column, old (version 1) folders still load, and runs written without step records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import (
    RunFormatError,
    RunRecorder,
    account_bubbles,
    codec,
    load_run,
    write_run,
)
from bubblesim.core.runfmt.io import REQUESTS, STEPS, SUMMARY, TIMELINE
from bubblesim.core.runfmt.summary import FORMAT_VERSION
from bubblesim.core.runfmt.tables import gc_table, requests_table, steps_table
from bubblesim.core.shape import BatchShape

TRACE = {"path": "traces/x.parquet", "sha256": "0" * 64, "rows": 1}
SIM = {"kind": "sim"}


def random_recorder(seed: int, n_steps: int = 3000, n_req: int = 40) -> RunRecorder:
    """Irregular float times (not on any grid), skipped phases (NaN), syncs, GC pauses, big
    counts (attn_pairs past int32), string request ids."""
    rng = np.random.default_rng(seed)
    r = RunRecorder()
    rows = [
        r.add_request(f"req-{i}", float(a))
        for i, a in enumerate(np.sort(rng.uniform(0, 0.3, n_req)))
    ]
    t = gpu_free = 0.1 * math.pi
    for _ in range(n_steps):
        shape = BatchShape(
            num_reqs=int(rng.integers(1, 64)),
            decode_tokens=int(rng.integers(0, 64)),
            attn_pairs=int(rng.integers(0, 1 << 40)),
            kv_read_tokens=int(rng.integers(0, 100_000)),
        )
        s = r.add_step(shape)
        for p in CPU_PHASES:
            if rng.random() < 0.8:
                d = float(rng.exponential(1e-4))
                r.phase(s, p, t, t + d)
                if rng.random() < 0.01:
                    r.gc_pause(t, d / 3, int(rng.integers(0, 3)), p)
                t += d
        if rng.random() < 0.5:
            r.sync(s, t, t + float(rng.exponential(1e-3)))
        if rng.random() < 0.95:  # one stream: after the previous step's GPU work
            g0 = max(t, gpu_free) + float(rng.exponential(1e-4))
            gpu_free = g0 + float(rng.exponential(5e-3))
            r.gpu(s, g0, gpu_free)
            t = g0
        t += float(rng.exponential(2e-3))
    for row in rows:
        r.tokens(row, t + rng.uniform(0, 1))
        if rng.random() < 0.9:
            r.finish(row, t + 2)
    return r


def _tables(r: RunRecorder) -> dict[str, pa.Table]:
    rec = r.freeze()
    bub = account_bubbles(rec)
    return {"requests": requests_table(rec), "steps": steps_table(rec, bub), "gc": gc_table(rec)}


def assert_same_table(got: pa.Table, want: pa.Table, what: str) -> None:
    """Same names, types and values; floats bit for bit (NaN included)."""
    assert got.column_names == want.column_names, what
    for name in want.column_names:
        a, b = got.column(name), want.column(name)
        assert a.type == b.type, f"{what}.{name}: {a.type} != {b.type}"
        if pa.types.is_floating(b.type):
            x, y = a.to_numpy(), b.to_numpy()
            assert x.view(np.int64).tolist() == y.view(np.int64).tolist(), f"{what}.{name}"
        else:
            assert a.to_pylist() == b.to_pylist(), f"{what}.{name}"


def _write(out: Path, r: RunRecorder, **kw: object) -> dict:
    return write_run(out, r, config={"model": "tiny"}, trace=TRACE, source=SIM, **kw)  # type: ignore[arg-type]


def test_every_column_round_trips_exactly(tmp_path: Path) -> None:
    _write(tmp_path / "run", random_recorder(1))
    run = load_run(tmp_path / "run")
    want = _tables(random_recorder(1))
    assert run.summary["format_version"] == FORMAT_VERSION == 2
    assert run.summary["step_records"] is True
    for name, table in want.items():
        assert_same_table(getattr(run, name), table, name)
    assert run.steps.column("attn_pairs").to_numpy().max() > np.iinfo(np.int32).max


def test_stored_encoding(tmp_path: Path) -> None:
    """Floats as int64 DELTA_BINARY_PACKED bit patterns, counts as int32 where they fit."""
    _write(tmp_path / "run", random_recorder(2))
    f = pq.ParquetFile(tmp_path / "run" / STEPS)
    schema = f.schema_arrow
    assert schema.metadata[codec.CODEC_KEY] == codec.CODEC_VERSION
    meta = f.metadata.row_group(0)
    enc = {meta.column(i).path_in_schema: meta.column(i).encodings for i in range(meta.num_columns)}
    for name in ("gpu_start_s", "schedule_end_s", "bubble_before_s"):
        assert schema.field(name).type == pa.int64()
        assert schema.field(name).metadata[codec.TYPE_KEY] == b"float64"
        assert "DELTA_BINARY_PACKED" in enc[name]
    assert schema.field("num_reqs").type == pa.int32()
    assert schema.field("attn_pairs").type == pa.int64()  # values past int32
    assert schema.field("bubble_cause").type == pa.string()
    assert meta.column(0).compression == "ZSTD"


def test_codec_exact_on_awkward_floats(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, -1e308, 1e308, 1.0]
    weird_nan = np.array([0x7FF8DEADBEEF0001], np.int64).view(np.float64)  # a NaN payload
    a = np.concatenate([special, weird_nan, rng.normal(0, 1e6, 500)])
    t = pa.table(
        {
            "a": a,
            "b": a[::-1].copy(),
            "c": a + 1.0,  # refs anything
            "same": a,
            "n": np.arange(a.size, dtype=np.int64) << 33,
            "s": [str(i % 7) for i in range(a.size)],
        }
    )
    codec.write_table(t, tmp_path / "t.parquet")
    assert_same_table(codec.read_table(tmp_path / "t.parquet"), t, "t")
    empty = t.slice(0, 0)
    codec.write_table(empty, tmp_path / "e.parquet")
    assert_same_table(codec.read_table(tmp_path / "e.parquet"), empty, "empty")


def test_bad_codec_metadata_is_one_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _write(out, random_recorder(4, n_steps=50))
    t = pq.read_table(out / STEPS)
    i = t.schema.get_field_index("gpu_end_s")
    cyc = t.schema.field(i).with_metadata(
        {codec.TYPE_KEY: b"float64", codec.REF_KEY: b"gpu_end_s", codec.DIFFED_KEY: b"0"}
    )
    pq.write_table(t.cast(t.schema.set(i, cyc)), out / STEPS)
    with pytest.raises(RunFormatError, match="gpu_end_s.*cycle"):
        load_run(out)


def _as_version_1(out: Path) -> None:
    """Rewrite a run folder the way format version 1 wrote it: plain zstd parquet of the
    decoded tables, no `step_records` key."""
    for name in ("requests", "steps", "gc"):
        path = out / f"{name}.parquet"
        table = codec.read_table(path)
        table = table.replace_schema_metadata(None)
        pq.write_table(table, path, compression="zstd")
    summary = json.loads((out / SUMMARY).read_text())
    summary["format_version"] = 1
    del summary["step_records"]
    (out / SUMMARY).write_text(json.dumps(summary))


def test_version_1_folders_still_load(tmp_path: Path) -> None:
    new, old = tmp_path / "new", tmp_path / "old"
    _write(new, random_recorder(5))
    _write(old, random_recorder(5))
    _as_version_1(old)
    assert pq.read_schema(old / STEPS).field("gpu_start_s").type == pa.float64()
    a, b = load_run(new), load_run(old)
    assert b.summary["format_version"] == 1 and b.has_steps
    for name in ("requests", "steps", "gc"):
        assert_same_table(getattr(b, name), getattr(a, name), name)


def test_no_steps_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    summary = _write(out, random_recorder(6, n_steps=200), steps=False)
    assert sorted(p.name for p in out.iterdir()) == sorted(["gc.parquet", REQUESTS, SUMMARY])
    assert summary["step_records"] is False and summary["timeline"] is None
    full = _write(tmp_path / "full", random_recorder(6, n_steps=200))
    assert (tmp_path / "full" / TIMELINE).is_file()
    for key in ("bubble_fraction", "bubble_s_by_cause", "num_steps", "tpot_s", "gpu_busy_s"):
        assert summary[key] == full[key], key
    run = load_run(out)
    assert not run.has_steps and run.requests.num_rows == 40
    with pytest.raises(RunFormatError, match="no step records.*--no-steps"):
        run.arrays("steps")


def test_compare_and_calibrate_refuse_a_run_without_steps(tmp_path: Path) -> None:
    from replay.analysis.compare import compare_runs
    from replay.analysis.steps import load_steps

    _write(tmp_path / "a", random_recorder(7, n_steps=100))
    _write(tmp_path / "b", random_recorder(7, n_steps=100), steps=False)
    a, b = load_run(tmp_path / "a"), load_run(tmp_path / "b")
    with pytest.raises(RunFormatError, match="'.*b' has no step records"):
        compare_runs(a, b)
    with pytest.raises(RunFormatError, match="no step records"):
        load_steps([b])


def test_sim_run_no_steps_command(tmp_path: Path) -> None:
    from sim.__main__ import main

    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "traces/smoke.parquet",
                "--set",
                "model=tiny",
                "-q",
                "--no-steps",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert not (out / STEPS).exists() and not (out / TIMELINE).exists()
    run = load_run(out)
    assert run.summary["step_records"] is False and run.summary["num_steps"] > 0
