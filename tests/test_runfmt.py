"""Run format (Contract 3): recorder, bubble accounting, atomic writer, reader, timeline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bubblesim.core.runfmt.io as runio
from bubblesim.core.config import Config, from_dict
from bubblesim.core.phases import CAUSE_LAUNCH_GAP, CPU_PHASES, GC, SYNC
from bubblesim.core.runfmt import (
    CAUSES,
    RecordingError,
    RunFormatError,
    RunRecorder,
    account_bubbles,
    load_run,
    trace_info,
    write_run,
)
from bubblesim.core.runfmt.sketch import LogHistogram
from bubblesim.core.runfmt.stats import weighted_quantiles
from bubblesim.core.runfmt.summary import REQUIRED_KEYS
from bubblesim.core.runfmt.tables import REQUEST_COLUMNS, STEP_COLUMNS
from bubblesim.core.runfmt.timeline import TRACKS
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape

TRACE = {"path": "traces/x.parquet", "sha256": "0" * 64, "rows": 2}
SIM = {"kind": "sim"}
DECODE = BatchShape(num_reqs=1, decode_tokens=1)


def _write(out: Path, rec: RunRecorder, **kw: object) -> dict:
    args: dict = {"config": {"model": "tiny"}, "trace": TRACE, "source": SIM, **kw}
    return write_run(out, rec, **args)


def hand_built() -> RunRecorder:
    """Two requests with a no-request idle stretch between them.

    t:   0     1    1.5    3   3.5  4  4.5  4.6  5    6   6.5 ...  10  10.5  11  12  12.5
    A arrives 0, B arrives 10.
    step 0: schedule [0,1], launch [1,1.5], gpu [1.5,3]          gap [0,1.5]: schedule 1, launch .5
    step 1: schedule [3,3.5], sync [3.5,4], gc [4,4.5] in launch [4,4.6], gpu [5,6]
            gap [3,5]: schedule .5, sync .5, gc .5, launch .1, launch_gap .4
    A: process_outputs [6,6.5], finishes 6.5  -> idle [6.5,10] (no request) is not a bubble
    step 2: schedule [10,10.5], gpu [11,12]   gap [6,11]: bubble [6,6.5] process_outputs,
            idle [6.5,10], bubble [10,10.5] schedule, [10.5,11] launch_gap
    B: finishes 12.5 (process_outputs [12,12.5]) -> trailing bubble .5 process_outputs
    """
    r = RunRecorder()
    a = r.add_request("A", 0.0)
    s = r.add_step(BatchShape(num_reqs=1, num_prefill_reqs=1, prefill_tokens=10))
    r.phase(s, "schedule", 0.0, 1.0)
    r.phase(s, "launch", 1.0, 1.5)
    r.gpu(s, 1.5, 3.0)
    r.tokens(a, 3.0)
    s = r.add_step(DECODE)
    r.phase(s, "schedule", 3.0, 3.5)
    r.sync(s, 3.5, 4.0)
    r.gc_pause(4.0, 0.5, 0, "launch")
    r.phase(s, "launch", 4.0, 4.6)
    r.gpu(s, 5.0, 6.0)
    r.tokens(a, 6.0, n=3, accepted_draft=2)
    r.accepted(s, 2)
    r.phase(s, "process_outputs", 6.0, 6.5)
    r.finish(a, 6.5)
    b = r.add_request("B", 10.0)
    s = r.add_step(BatchShape(num_reqs=1, num_prefill_reqs=1, prefill_tokens=5))
    r.phase(s, "schedule", 10.0, 10.5)
    r.gpu(s, 11.0, 12.0)
    r.tokens(b, 12.0)
    r.phase(s, "process_outputs", 12.0, 12.5)
    r.finish(b, 12.5)
    return r


def test_hand_built_bubbles_exact() -> None:
    bub = account_bubbles(hand_built().freeze())
    assert bub.start_s == 0.0 and bub.end_s == 12.5
    assert bub.busy_s == pytest.approx(1.5 + 1.0 + 1.0)
    assert bub.idle_s == pytest.approx(3.5)  # [6.5, 10]: nobody in the engine
    assert bub.bubble_s == pytest.approx(1.5 + 2.0 + 1.5 + 0.5)
    want = dict.fromkeys(CAUSES, 0.0)
    want.update(
        {"schedule": 1.0 + 0.5 + 0.5, "launch": 0.5 + 0.1, SYNC: 0.5, GC: 0.5},
        process_outputs=0.5 + 0.5,
    )
    want[CAUSE_LAUNCH_GAP] = 0.4 + 0.5
    assert bub.by_cause == pytest.approx(want, abs=1e-12)
    np.testing.assert_allclose(bub.gpu_idle_before_s, [1.5, 2.0, 5.0])
    np.testing.assert_allclose(bub.bubble_before_s, [1.5, 2.0, 1.5])
    # ties (step 1: schedule, sync, gc .5 each) go to the first cause in CAUSES order
    assert list(bub.bubble_cause) == ["schedule", "schedule", "schedule"]
    assert bub.bubble_fraction == pytest.approx(5.5 / (3.5 + 5.5))


def test_idle_without_requests_is_not_bubble() -> None:
    r = RunRecorder()
    for i, t in enumerate((0.0, 100.0)):
        q = r.add_request(i, t)
        s = r.add_step(DECODE)
        r.gpu(s, t, t + 1.0)  # the GPU starts at arrival: no bubble at all
        r.tokens(q, t + 1.0)
        r.finish(q, t + 1.0)
    bub = account_bubbles(r.freeze())
    assert bub.bubble_s == 0.0 and bub.busy_s == 2.0 and bub.idle_s == 99.0
    assert bub.span_s == 101.0
    assert list(bub.bubble_cause) == ["", ""]
    np.testing.assert_allclose(bub.gpu_idle_before_s, [0.0, 99.0])
    np.testing.assert_allclose(bub.bubble_before_s, [0.0, 0.0])


# ---- randomized invariants against a brute-force reference ----------------------------------


def reference(r: RunRecorder) -> dict[str, float]:
    """Per elementary segment, plain Python: busy / bubble by cause / idle."""
    rec = r.freeze()
    gpu = [(s, e) for s, e in zip(rec.gpu_start, rec.gpu_end) if not math.isnan(s)]
    end = max([*rec.finish[~np.isnan(rec.finish)], *[e for _, e in gpu], *rec.arrival])
    start = min([*rec.arrival, *[s for s, _ in gpu]])
    reqs = [(a, end if math.isnan(f) else f) for a, f in zip(rec.arrival, rec.finish)]
    acts: list[tuple[str, float, float]] = [
        (GC, s, s + d) for s, d in zip(rec.gc_start, rec.gc_dur)
    ]
    acts += [(SYNC, s, e) for s, e in zip(rec.sync_start, rec.sync_end)]
    for j, p in enumerate(CPU_PHASES):
        acts += [(p, s, e) for s, e in zip(rec.phase_start[:, j], rec.phase_end[:, j])]
    acts = [a for a in acts if not math.isnan(a[1])]
    pts = {start, end}
    for s, e in gpu + reqs:
        pts |= {s, e}
    for _, s, e in acts:
        pts |= {min(max(s, start), end), min(max(e, start), end)}
    pts_sorted = sorted(pts)
    out = dict.fromkeys(("busy", "idle", *CAUSES), 0.0)
    for lo, hi in zip(pts_sorted, pts_sorted[1:]):
        m, d = (lo + hi) / 2, hi - lo
        if any(s < m < e for s, e in gpu):
            out["busy"] += d
        elif not any(a < m < f for a, f in reqs):
            out["idle"] += d
        else:
            cover = [name for name, s, e in acts if s < m < e]
            prio = [GC, SYNC, *CPU_PHASES]
            cause = min(cover, key=prio.index) if cover else CAUSE_LAUNCH_GAP
            out[cause] += d
    out["span"] = end - start
    return out


@st.composite
def random_runs(draw: st.DrawFn) -> RunRecorder:
    """Steps on a quarter-second grid (many coincident boundaries), random requests."""
    r = RunRecorder()
    q = st.integers(0, 8).map(lambda k: k / 4)
    n_req = draw(st.integers(1, 5))
    arrivals = sorted(draw(st.lists(st.integers(0, 80), min_size=n_req, max_size=n_req)))
    rows = [r.add_request(i, a / 4) for i, a in enumerate(arrivals)]
    t = arrivals[0] / 4 + draw(q)
    for _ in range(draw(st.integers(0, 12))):
        s = r.add_step(DECODE)
        cpu_t = t
        for p in CPU_PHASES:
            if draw(st.booleans()):
                d = draw(q)
                r.phase(s, p, cpu_t, cpu_t + d)
                if d and draw(st.integers(0, 4)) == 0:
                    r.gc_pause(cpu_t, d / 2, draw(st.integers(0, 2)), p)
                cpu_t += d + draw(q)
        if draw(st.booleans()):
            r.sync(s, cpu_t, cpu_t + draw(q))
        g0 = t + draw(q)
        g1 = g0 + draw(q)
        if draw(st.integers(0, 5)):
            r.gpu(s, g0, g1)
            t = g1
        t += draw(q)
    for row, a in zip(rows, arrivals):
        if draw(st.integers(0, 5)):  # a few never finish (an incomplete run)
            r.finish(row, a / 4 + draw(st.integers(0, 40)) / 4)
    return r


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_runs())
def test_bubble_invariants_random(r: RunRecorder) -> None:
    rec = r.freeze()
    bub = account_bubbles(rec)
    ref = reference(r)
    assert bub.busy_s + bub.bubble_s + bub.idle_s == pytest.approx(bub.span_s, abs=1e-9)
    assert bub.span_s == pytest.approx(ref["span"])
    assert bub.busy_s == pytest.approx(ref["busy"], abs=1e-9)
    assert bub.idle_s == pytest.approx(ref["idle"], abs=1e-9)
    assert bub.by_cause == pytest.approx({c: ref[c] for c in CAUSES}, abs=1e-9)
    assert sum(bub.by_cause.values()) == pytest.approx(bub.bubble_s, abs=1e-9)
    has_gpu = ~np.isnan(rec.gpu_start)
    # per-step parts never exceed their gap and sum, with the trailing gap, to the totals
    assert np.all(bub.bubble_before_s[has_gpu] <= bub.gpu_idle_before_s[has_gpu] + 1e-12)
    assert np.isnan(bub.bubble_before_s[~has_gpu]).all()
    assert np.nansum(bub.bubble_before_s) <= bub.bubble_s + 1e-9
    # GPU intervals never overlap
    s, e = rec.gpu_start[has_gpu], rec.gpu_end[has_gpu]
    order = np.argsort(s)
    assert np.all(s[order][1:] >= e[order][:-1])
    # chunking the gaps changes nothing
    small = account_bubbles(rec, chunk_gaps=2)
    assert small.by_cause == pytest.approx(bub.by_cause, abs=1e-12)
    assert np.array_equal(small.bubble_cause_code, bub.bubble_cause_code)
    for a, b in zip(
        (small.piece_start, small.piece_end, small.piece_cause),
        (bub.piece_start, bub.piece_end, bub.piece_cause),
    ):
        assert np.array_equal(a, b)
    assert np.sum(bub.piece_end - bub.piece_start) == pytest.approx(bub.bubble_s, abs=1e-9)
    # a step has a cause exactly when it has a bubble
    assert np.array_equal(bub.bubble_cause != "", np.nan_to_num(bub.bubble_before_s) > 0)


def test_gpu_overlap_is_refused() -> None:
    r = RunRecorder()
    r.add_request(0, 0.0)
    for s0 in (0.0, 0.5):
        r.gpu(r.add_step(DECODE), s0, s0 + 1.0)
    with pytest.raises(RecordingError, match="step 1: GPU interval starts"):
        account_bubbles(r.freeze())


def test_recorder_refuses_misuse() -> None:
    r = RunRecorder()
    s = r.add_step(DECODE)
    r.phase(s, "schedule", 0.0, 1.0)
    with pytest.raises(ValueError, match="recorded twice in step 0"):
        r.phase(s, "schedule", 1.0, 2.0)
    with pytest.raises(ValueError, match="unknown CPU phase 'nap'"):
        r.phase(s, "nap", 1.0, 2.0)
    with pytest.raises(IndexError, match="step 1 was not added"):
        r.gpu(1, 0.0, 1.0)
    q = r.add_request("x", 0.0)
    r.tokens(q, 2.0)
    with pytest.raises(ValueError, match="before the last"):
        r.tokens(q, 1.0)
    r.phase(s, "sync", 1.0, 1.25)  # routed to sync(): any number per step
    r.phase(s, "sync", 1.5, 1.75)
    r.phase(s, "prepare_inputs", 2.0, 1.5)
    with pytest.raises(RecordingError, match="step 0: phase 'prepare_inputs' ends before"):
        r.freeze()
    r2 = RunRecorder()
    r2.add_request(1, 0.0)
    r2.add_request(1, 1.0)
    with pytest.raises(RecordingError, match="request row 1: duplicate request_id 1"):
        r2.freeze()


def test_sync_waits_any_number_per_step(tmp_path: Path) -> None:
    r = hand_built()
    r.phase(1, "sync", 4.7, 4.8)  # a second wait in step 1, via phase(): routed to sync()
    rec = r.freeze()
    assert rec.sync_step.tolist() == [1, 1]
    _write(tmp_path / "run", r)
    steps = load_run(tmp_path / "run").arrays("steps")
    assert steps["sync_count"].tolist() == [0, 2, 0]
    np.testing.assert_allclose(steps["sync_s"], [0.0, 0.6, 0.0])
    assert (steps["sync_start_s"][1], steps["sync_end_s"][1]) == (3.5, 4.0)  # the longest


def test_many_steps_grow_chunks() -> None:
    r = RunRecorder(chunk_steps=8)
    for i in range(100):
        s = r.add_step(BatchShape(num_reqs=i))
        r.phase(s, "draft", float(i), i + 0.5)
    rec = r.freeze()
    assert rec.shape.shape == (100, len(SHAPE_FIELDS))
    assert rec.shape[:, 0].tolist() == list(range(100))
    assert rec.phase_start[:, CPU_PHASES.index("draft")].tolist() == [float(i) for i in range(100)]


# ---- inter-token latency ----------------------------------------------------------------------


def _itl_samples(rng: np.random.Generator, r: RunRecorder, n_req: int) -> np.ndarray:
    """Feed emissions; return the exact per-token ITL samples (records.py definition)."""
    samples: list[np.ndarray] = []
    for i in range(n_req):
        q = r.add_request(i, 0.0)
        t = float(rng.uniform(0, 1))
        n_emit = int(rng.integers(1, 40))
        gaps = rng.lognormal(np.log(0.02), 0.6, n_emit)
        ns = rng.integers(1, 5, n_emit)
        for j in range(n_emit):
            if j:
                t += float(gaps[j])
                samples.append(np.full(ns[j], gaps[j] / ns[j]))
            else:
                samples.append(np.zeros(ns[j] - 1))
            r.tokens(q, t, int(ns[j]))
        r.finish(q, t)
    return np.concatenate(samples)


def test_itl_exact_when_small() -> None:
    r = RunRecorder()
    exact = _itl_samples(np.random.default_rng(1), r, 200)
    rec = r.freeze()
    assert rec.itl_exact
    want = np.quantile(exact, [0.5, 0.9, 0.99])
    got = [rec.itl_quantiles[k] for k in ("p50", "p90", "p99")]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_itl_sketch_within_one_percent() -> None:
    r = RunRecorder(itl_exact_limit=500)  # fold into the histogram many times
    exact = _itl_samples(np.random.default_rng(2), r, 3000)
    rec = r.freeze()
    assert not rec.itl_exact
    want = np.quantile(exact, [0.5, 0.9, 0.99])
    got = np.array([rec.itl_quantiles[k] for k in ("p50", "p90", "p99")])
    np.testing.assert_allclose(got, want, rtol=2e-3)  # the sketch guarantees 0.1 %


def test_itl_mean_is_tpot_mean_weighted(tmp_path: Path) -> None:
    r = RunRecorder()
    exact = _itl_samples(np.random.default_rng(3), r, 50)
    summary = _write(tmp_path / "run", r)
    assert summary["itl_s"]["mean"] == pytest.approx(exact.mean(), rel=1e-9)
    assert summary["itl_count"] == exact.size


@given(
    st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=30),
    st.data(),
)
def test_weighted_quantiles_match_expanded(values: list[float], data: st.DataObject) -> None:
    w = data.draw(st.lists(st.integers(0, 4), min_size=len(values), max_size=len(values)))
    if sum(w) == 0:
        w[0] = 1
    qs = [0.0, 0.5, 0.9, 0.99, 1.0]
    want = np.quantile(np.repeat(values, w), qs)
    np.testing.assert_allclose(weighted_quantiles(np.array(values), np.array(w), qs), want)


def test_log_histogram_relative_error() -> None:
    x = np.random.default_rng(4).lognormal(-5, 2, 20_000)
    h = LogHistogram()
    h.add(x)
    qs = [0.01, 0.5, 0.9, 0.99]
    np.testing.assert_allclose(h.quantiles(qs), np.quantile(x, qs), rtol=1.01e-3)
    with pytest.raises(ValueError):
        h.add(np.array([-1.0]))


# ---- the run folder ---------------------------------------------------------------------------


def test_write_and_load_roundtrip(tmp_path: Path) -> None:
    out = tmp_path / "run"
    summary = _write(out, hand_built(), extra={"repeat": 1})
    assert sorted(p.name for p in out.iterdir()) == sorted(runio.RUN_FILES)
    run = load_run(out)
    for key in REQUIRED_KEYS:
        assert key in run.summary
    for key in ("span_s", "num_steps", "gpu_ms_mean", "cpu_ms_mean", "gc", "repeat"):
        assert key in run.summary
    assert run.summary == json.loads(json.dumps(summary))
    assert run.summary["complete"] is True
    assert run.summary["source"] == SIM
    assert run.summary["bubble_s_by_cause"]["gc"] == pytest.approx(0.5)
    assert run.summary["gc"]["count"] == 1 and run.summary["gc"]["by_generation"]["0"]["count"] == 1
    assert run.summary["cpu_ms_mean"]["schedule"] == pytest.approx(2000 / 3)
    assert run.summary["gpu_ms_mean"] == pytest.approx(3500 / 3)
    for dist_key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(run.summary[dist_key]) == {"p50", "p90", "p99", "mean"}
    assert run.summary["output_tok_per_s"] == pytest.approx(5 / 12.5)
    assert run.summary["req_per_s"] == pytest.approx(2 / 12.5)

    assert tuple(run.requests.column_names) == REQUEST_COLUMNS
    assert run.requests.schema.field("request_id").type == pa.string()
    req = run.arrays("requests")
    np.testing.assert_allclose(req["ttft_s"], [3.0, 2.0])
    np.testing.assert_allclose(req["tpot_s"], [3.0 / 3, np.nan])
    np.testing.assert_allclose(req["e2e_s"], [6.5, 2.5])
    assert req["output_tokens"].tolist() == [4, 1]
    assert req["accepted_draft_tokens"].tolist() == [2, 0]

    assert tuple(run.steps.column_names) == STEP_COLUMNS
    schema = run.steps.schema
    assert all(schema.field(f).type == pa.int64() for f in SHAPE_FIELDS)
    assert schema.field("bubble_cause").type == pa.string()
    assert schema.field("gpu_start_s").type == pa.float64()
    steps = run.arrays("steps")
    assert steps["step"].tolist() == [0, 1, 2]
    assert steps["bubble_cause"].tolist() == ["schedule", "schedule", "schedule"]
    np.testing.assert_allclose(steps["bubble_before_s"], [1.5, 2.0, 1.5])
    np.testing.assert_allclose(steps["gc_s"], [0.0, 0.5, 0.0])
    assert steps["gc_count"].tolist() == [0, 1, 0]
    np.testing.assert_allclose(steps["sync_s"], [0.0, 0.5, 0.0])
    assert np.isnan(steps["draft_start_s"]).all()
    assert steps["accepted_draft_tokens"].tolist() == [0, 2, 0]
    assert run.gc.column("phase").to_pylist() == ["launch"]


def test_config_object_and_trace_info(tmp_path: Path) -> None:
    trace_path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"request_id": [1, 2, 3]}), trace_path)
    info = trace_info(trace_path)
    assert info["rows"] == 3 and len(info["sha256"]) == 64
    summary = _write(tmp_path / "run", hand_built(), config=Config(), trace=info)
    assert from_dict(summary["config"]) == Config()
    assert summary["trace"] == info


def test_int_request_ids_stay_int(tmp_path: Path) -> None:
    r = RunRecorder()
    q = r.add_request(np.int64(5), 0.0)
    r.finish(q, 1.0)
    _write(tmp_path / "run", r)
    run = load_run(tmp_path / "run")
    assert run.requests.schema.field("request_id").type == pa.int64()
    assert run.summary["tpot_s"]["p50"] is None  # no request with 2 tokens: null, not NaN


def test_write_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    _write(out, hand_built())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = {"n": 0}
    real = runio.pq.write_table

    def failing(*args: object, **kw: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # requests.parquet is written, steps.parquet fails
            raise OSError("disk full")
        real(*args, **kw)

    monkeypatch.setattr(runio.pq, "write_table", failing)
    r = hand_built()
    r.add_request("C", 20.0)
    with pytest.raises(OSError, match="disk full"):
        _write(out, r)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temp folder left
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # previous run intact
    calls["n"] = 0
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path / "fresh", hand_built())
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_replaces_previous_run_refuses_other_folders(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _write(out, hand_built())
    r = hand_built()
    r.add_request("C", 20.0)
    _write(out, r, complete=False)
    run = load_run(out)
    assert run.summary["num_requests"] == 3 and run.complete is False
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(RunFormatError, match="exists and is not a run folder"):
        _write(other, hand_built())
    assert (other / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    _write(empty, hand_built())
    load_run(empty)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(RunFormatError, match="'kind' must be"):
        _write(tmp_path / "a", hand_built(), source={"kind": "guess"})
    with pytest.raises(RunFormatError, match="must name its 'gpu'"):
        _write(tmp_path / "a", hand_built(), source={"kind": "replay"})
    with pytest.raises(RunFormatError, match="trace: missing"):
        _write(tmp_path / "a", hand_built(), trace={"path": "x"})
    with pytest.raises(ValueError, match="clashes"):
        _write(tmp_path / "a", hand_built(), extra={"span_s": 1})
    with pytest.raises(TypeError, match="not JSON serializable"):
        _write(tmp_path / "a", hand_built(), extra={"obj": object()})
    assert list(tmp_path.iterdir()) == []


def test_load_run_refuses_non_runs(tmp_path: Path) -> None:
    with pytest.raises(RunFormatError, match="no such directory"):
        load_run(tmp_path / "missing")
    with pytest.raises(RunFormatError, match="no summary.json"):
        load_run(tmp_path)
    (tmp_path / "summary.json").write_text('{"hello": 1}')
    with pytest.raises(RunFormatError, match="not a run summary"):
        load_run(tmp_path)
    out = tmp_path / "run"
    _write(out, hand_built())
    (out / "steps.parquet").unlink()
    with pytest.raises(RunFormatError, match="no steps.parquet"):
        load_run(out)


# ---- timeline ---------------------------------------------------------------------------------


def _tracks(trace: dict) -> set[tuple[int, int, str]]:
    return {
        (e["pid"], e["tid"], e["args"]["name"])
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def test_timeline_tracks(tmp_path: Path) -> None:
    _write(tmp_path / "sim", hand_built())
    _write(tmp_path / "replay", hand_built(), source={"kind": "replay", "gpu": "H100"})
    sim = json.loads((tmp_path / "sim" / "timeline.json").read_text())
    rep = json.loads((tmp_path / "replay" / "timeline.json").read_text())
    assert _tracks(sim) == _tracks(rep) == {(p, t, name) for p, t, _, name in TRACKS}
    procs = {e["args"]["name"] for e in sim["traceEvents"] if e["name"] == "process_name"}
    assert procs == {"CPU", "GPU", "requests"}
    by_cat: dict[str, set[tuple[int, int]]] = {}
    for e in sim["traceEvents"]:
        if e["ph"] == "X":
            by_cat.setdefault(e["cat"], set()).add((e["pid"], e["tid"]))
            assert e["dur"] >= 0
    assert by_cat == {
        "cpu": {(1, 1)},
        "sync": {(1, 1)},
        "gc": {(1, 2)},
        "gpu": {(2, 1)},
        "bubble": {(2, 2)},
    }
    bubbles = [e for e in sim["traceEvents"] if e.get("cat") == "bubble"]
    assert {e["name"] for e in bubbles} <= set(CAUSES)
    assert sum(e["dur"] for e in bubbles) == pytest.approx(5.5e6)
    gpu = [e for e in sim["traceEvents"] if e.get("cat") == "gpu"]
    assert [e["args"]["step"] for e in gpu] == [0, 1, 2]
    assert gpu[0]["ts"] == 1.5e6 and gpu[0]["dur"] == 1.5e6 and gpu[0]["name"] == "prefill"
    counter = [e["args"]["requests"] for e in sim["traceEvents"] if e["ph"] == "C"]
    assert counter == [1, 0, 1, 0]
    assert sim["otherData"]["truncated"] is False


def test_timeline_capped(tmp_path: Path) -> None:
    r = RunRecorder()
    q = r.add_request(0, 0.0)
    for i in range(50):
        s = r.add_step(DECODE)
        r.phase(s, "schedule", 2.0 * i, 2.0 * i + 0.5)
        r.gpu(s, 2.0 * i + 1, 2.0 * i + 2)
        r.tokens(q, 2.0 * i + 2)
    r.finish(q, 100.0)
    summary = _write(tmp_path / "run", r, timeline_max_steps=10)
    tl = json.loads((tmp_path / "run" / "timeline.json").read_text())
    assert tl["otherData"]["steps_exported"] == 10 and tl["otherData"]["truncated"] is True
    assert summary["timeline"]["steps_total"] == 50
    gpu = [e for e in tl["traceEvents"] if e.get("cat") == "gpu"]
    assert len(gpu) == 10
    assert max(e["ts"] for e in tl["traceEvents"] if e["ph"] != "M") < 20e6
    assert summary["num_steps"] == 50  # the parquet files and summary keep every step
    assert load_run(tmp_path / "run").steps.num_rows == 50
