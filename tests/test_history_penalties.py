"""The penalties' GPU cost, end to end on CPU: the sweep's decode(history) rows (grid, staging on
the tiny engine, file column), their fit (replay.analysis.historyfit, replay calibrate) and the cost
model's all-or-nothing term (`gpu_pass.history`), fast-forward parity included."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bubblesim.core.config import Config
from bubblesim.core.graph_buckets import decode_buckets, decode_graph_rows
from bubblesim.core.shape import BatchShape
from bubblesim.core.trace import make_trace, write_trace
from replay.analysis.historyfit import describe, fit_history, history_pairs
from replay.analysis.shapes_file import Sample, read_sweeps, shape_row, write_sweep
from replay.analysis.shapes_grid import Batch, Entry, Limits, batch_shape, grid
from replay.gpu.shapes_step import stage
from sim.cost import CostModel, merge_profile, resolve_profile, save_profile, validate_profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_without_and_with_fast_forward  # noqa: E402

LIM = Limits(max_tokens=2048, max_seqs=64, max_len=32768, kv_tokens=64 * 16 * 300)


# ---- the grid -----------------------------------------------------------------------------------
def test_history_cells_pair_with_decode_cells_and_come_last(monkeypatch):
    batches = grid(LIM)
    plain = {b.entries for b in batches if b.label == "decode"}
    hist = [b for b in batches if b.label.startswith("decode(history")]
    assert {b.label for b in hist} == {"decode(history)", "decode(history mix)"}
    full = [b for b in hist if b.label == "decode(history)"]
    assert {len(b.entries) for b in full} == set(LIM.decode_buckets())
    for b in hist:  # the same cell without history is a decode-family batch
        twin = tuple(Entry(e.start, e.n, e.prefill, e.drafts) for e in b.entries)
        assert twin in plain, b
        n_hist = sum(e.hist for e in b.entries)
        assert n_hist >= 1 and batch_shape(b.entries)["history_tokens"] == n_hist
        assert n_hist == len(b.entries) or b.label == "decode(history mix)"
    # the families before keep their points and order (the new ones are left out)
    rest = [b for b in batches if not b.label.startswith("decode(history")]
    monkeypatch.setattr("replay.analysis.shapes_grid._history", lambda *a: None)
    no_hist = grid(LIM)  # the grid as it was before the history families
    assert rest == no_hist and all(not e.hist for b in rest for e in b.entries)


def test_decode_graph_rows_follow_the_engines_buckets():
    from engine.graphs import decode_buckets as engine_buckets

    assert engine_buckets is decode_buckets
    b = decode_buckets(256)
    assert [decode_graph_rows(n, 256, 8192) for n in (1, 3, 33, 65, 200, 256)] == [
        1, 4, 40, 80, 224, 256,
    ]  # fmt: skip
    assert decode_graph_rows(300, 256, 8192) == 300  # past every bucket: eager rows
    assert decode_graph_rows(9, 64, 64, 4) == 16  # spec: rows of max_tokens // (k + 1)
    assert b[-1] == 256


# ---- staging on the tiny engine -----------------------------------------------------------------
def test_history_rows_stage_as_a_runs_needs_history_requests():
    from engine.engine import Engine
    from replay.gpu.shapes_step import MarkHooks

    cfg = Config(
        model="tiny", device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=128,
        max_model_len=512, cuda_graphs=False, gc_freeze=False, batches_in_flight=2,
    )  # fmt: skip
    eng = Engine(cfg)
    eng.hooks = MarkHooks(eng.device)
    rows = (Entry(60, 1, False, hist=True), Entry(40, 1, False), Entry(90, 1, False, hist=True))
    with torch.no_grad():
        st = stage(eng, Batch("decode(history mix)", rows))
        shape = st.sched_batch.shape
        assert shape.as_dict() == batch_shape(rows)  # history_tokens 2: one output per row
        assert shape.history_tokens == 2
        for e, r in zip(rows, st.sched_batch.entries):
            s = eng.states[r.req.index]
            assert r.req.needs_history == e.hist
            counts = eng.sampler.counts[s.slot]
            if e.hist:  # the slot's history as a run's first step sets it up
                assert int(counts.sum()) == 1 and int(counts[s.output[0]]) == 1
                mask = eng.sampler.prompt_mask[s.slot]
                assert bool(mask[torch.as_tensor(s.prompt_ids[: e.start]).long()].all())
            else:
                assert int(counts.sum()) == 0
        for _ in range(2):
            st.before()
            st.launch()
            st.after()
    assert eng.sampler.penalties
    sample = Sample(1.0, 0.1, 0.0)
    row = shape_row(st.batch, [sample], 0, 0, 91, st.kv_blocks, False, shape.as_dict())
    assert row["history_rows"] == 2 and row["history_tokens"] == 2


# ---- the fit ------------------------------------------------------------------------------------
FIXED_MS, PER_ROW_MS = 0.03, 0.0012


def _plain_ms(b: Batch) -> float:
    return 0.5 + 0.004 * len(b.entries) + 2e-6 * sum(e.seq_len for e in b.entries)


def _bucket(n: int) -> int:
    return decode_graph_rows(n, LIM.max_seqs, LIM.max_tokens)


def _sweep_file(tmp: Path, noise: float = 0.0, **meta_kw: str) -> Path:
    """The grid's decode rows timed by a known model: history rows pay the penalty line per
    graph row, whatever share of rows has history (the engine's graph variant)."""
    rng = np.random.default_rng(1)
    rows = []
    for b in grid(LIM, ("decode",)):
        n = len(b.entries)
        ms = _plain_ms(b)
        if any(e.hist for e in b.entries):
            ms += FIXED_MS + PER_ROW_MS * _bucket(n)
        ms *= 1 + noise * rng.standard_normal()
        s = Sample(ms, 0.1, 0.0)
        rows.append(shape_row(b, [s], 0, _bucket(n), b.max_seq_len, 1, False))
    meta = {"format": "replay.shapes", "version": 1, "model": "tiny", "measures": "step"}
    return write_sweep(tmp / "sweep.parquet", rows, {**meta, **meta_kw})


def test_the_fit_gives_the_penalty_line_back(tmp_path: Path):
    sweep = read_sweeps([_sweep_file(tmp_path)])
    h, p = history_pairs(sweep)
    assert len(h) == int(sweep.history().sum()) > 10  # every history row found its pair
    assert (sweep.cols["history_tokens"][p] == 0).all()
    model, report = fit_history(sweep)
    assert model is not None
    assert model["ms"] == pytest.approx(FIXED_MS, abs=1e-9)
    assert model["ms_per_row"] == pytest.approx(PER_ROW_MS, rel=1e-9)
    assert report["err_abs_max"] < 1e-9 and report["mix_err_p50"] == pytest.approx(0, abs=1e-9)
    by_ctx = report["extra_us_per_row_by_context"]
    assert len(by_ctx) >= 2 and max(by_ctx.values()) > PER_ROW_MS * 1e3
    noisy = read_sweeps([_sweep_file(tmp_path, noise=0.01)])
    m2, _ = fit_history(noisy)
    assert m2 is not None and m2["ms_per_row"] == pytest.approx(PER_ROW_MS, rel=0.2)
    # without history rows (an older sweep): nothing fitted, one reason
    plain = sweep.subset(~sweep.history())
    none, why = fit_history(plain)
    assert none is None and "0 history rows" in why["why"]


def test_calibrate_fits_the_term_and_keeps_history_rows_out_of_the_decode_fit(tmp_path: Path):
    from test_replay_shapes import H100, eager_run

    from replay.analysis.calibrate import calibrate

    runs = [eager_run(tmp_path / "r", seed=1)]
    f = _sweep_file(tmp_path, gpu=H100, dtype="bfloat16")
    cal = calibrate(runs, shapes=[f], shapes_kinds=("decode", "mixed"), gpu_model="linear")
    hist = cal.profile["gpu_pass"]["history"]
    assert hist["ms"] == pytest.approx(FIXED_MS) and hist["ms_per_row"] == pytest.approx(PER_ROW_MS)
    assert cal.quality["gpu_pass.history"]["pairs"] > 10
    assert any(n.startswith("gpu_pass.history: ") for n in cal.notes)
    sweep = read_sweeps([f])
    plain = int((sweep.decode & ~sweep.history()).sum())
    assert cal.quality["gpu_pass.decode.fitted_on"]["shape_rows"] == plain
    validate_profile(cal.profile)


# ---- the cost model -----------------------------------------------------------------------------
def _cost(prof: dict, **kw) -> CostModel:
    cfg = Config(model="llama3.2-1b", max_num_seqs=256, max_num_batched_tokens=8192, **kw)
    return CostModel(cfg, prof)


def test_the_cost_model_adds_the_term_all_or_nothing_per_graph_row():
    decode = {"intercept": 1.0, "num_tokens": 0.01}
    hist = {"ms": 0.05, "ms_per_row": 0.002}
    prof = {"version": 1, "gpu_pass": {"decode": decode, "history": hist}}
    validate_profile(prof)
    cm = _cost(prof)
    for n in (1, 33, 200):
        plain = BatchShape(num_reqs=n, decode_tokens=n, kv_read_tokens=100 * n)
        with_h = BatchShape(num_reqs=n, decode_tokens=n, kv_read_tokens=100 * n, history_tokens=7)
        rows = decode_graph_rows(n, 256, 8192)
        assert cm.gpu_pass_ms(with_h) - cm.gpu_pass_ms(plain) == pytest.approx(0.05 + 0.002 * rows)
        assert cm.gpu_pass_ms(plain) == pytest.approx(1.0 + 0.01 * n)
    eager = _cost(prof, cuda_graphs=False)
    s = BatchShape(num_reqs=33, decode_tokens=33, history_tokens=1)
    assert eager.gpu_pass_ms(s) - eager.gpu_pass_ms(BatchShape(num_reqs=33, decode_tokens=33)) == (
        pytest.approx(0.05 + 0.002 * 33)
    )
    neutral = ("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)
    off = Config(model="llama3.2-1b").replace(**{f"sampling.{k}": v for k, v in neutral})
    assert CostModel(off, prof).gpu_pass_ms(s) == pytest.approx(1.0 + 0.01 * 33)
    # defaults: free; a partial table merges key by key
    zero = {"ms": 0.0, "ms_per_row": 0.0, "verify_ms": 0.0, "verify_ms_per_row": 0.0}
    assert resolve_profile(None)["gpu_pass"]["history"] == zero
    merged = merge_profile(resolve_profile(None), {"gpu_pass": {"history": {"ms": 0.2}}})
    assert merged["gpu_pass"]["history"] == {**zero, "ms": 0.2}
    with pytest.raises(ValueError, match="gpu_pass.history.ms_per_row"):
        validate_profile({"version": 1, "gpu_pass": {"history": {"ms_per_row": -1}}})


def _history_trace(tmp: Path) -> Path:
    rng = np.random.default_rng(5)
    n = 60
    t = make_trace(
        np.sort(rng.uniform(0, 3, n)),
        rng.integers(20, 400, n),
        rng.integers(40, 250, n),
        needs_history=np.arange(n) % 3 != 0,  # most requests, not all: steps of both kinds
    )
    return write_trace(t, tmp / "hist.parquet")


@pytest.mark.parametrize("spec", ["none", "ngram-gpu"])
def test_fast_forwards_keep_the_step_loops_costs_with_the_term(tmp_path: Path, spec: str):
    decode = {"intercept": 2.0, "num_tokens": 0.004, "kv_read_tokens": 2e-5}
    hist = {"ms": 0.3, "ms_per_row": 0.02}
    with_h = {"version": 1, "gpu_pass": {"decode": decode, "history": hist}}
    base = {"version": 1, "gpu_pass": {"decode": decode}}
    trace = _history_trace(tmp_path)
    outs = {}
    for name, p in (("term", with_h), ("base", base)):
        path = save_profile(tmp_path / f"{name}.json", p)
        sets = ["model=llama3.2-1b", f"spec.method={spec}", f"profile={path}"]
        outs[name] = records_without_and_with_fast_forward(sets, trace)
        assert_same_records(*outs[name], name)
    assert not np.array_equal(outs["term"][1].gpu_end, outs["base"][1].gpu_end)


def test_verify_steps_take_their_own_term_per_row_when_the_profile_has_one():
    """Spec verify steps apply the penalties to their history rows at every sampled position:
    their own line over the step's rows; without it (an older profile) the decode term."""
    decode = {"intercept": 1.0, "num_tokens": 0.01}
    hist = {"ms": 0.05, "ms_per_row": 0.002}
    spec = {"spec.method": "ngram-gpu", "spec.k": 3}
    s = BatchShape(num_reqs=5, decode_tokens=5, draft_tokens=15, history_tokens=9)
    plain = BatchShape(num_reqs=5, decode_tokens=5, draft_tokens=15)
    old = _cost({"version": 1, "gpu_pass": {"decode": decode, "history": hist}}).config
    cm = CostModel(old.replace(**spec), {"version": 1, "gpu_pass": {"decode": decode,
                                                                    "history": hist}})  # fmt: skip
    rows = decode_graph_rows(5, 256, 8192, 4)
    assert cm.gpu_pass_ms(s) - cm.gpu_pass_ms(plain) == pytest.approx(0.05 + 0.002 * rows)
    own = {**hist, "verify_ms": 0.1, "verify_ms_per_row": 0.024}
    prof = {"version": 1, "gpu_pass": {"decode": decode, "history": own}}
    validate_profile(prof)
    cm = CostModel(old.replace(**spec), prof)
    assert cm.gpu_pass_ms(s) - cm.gpu_pass_ms(plain) == pytest.approx(0.1 + 0.024 * 5)
    # no drafts: the decode term (eager under spec decoding: its rows are the batch's)
    d = BatchShape(num_reqs=5, decode_tokens=5, history_tokens=9)
    assert cm.gpu_pass_ms(d) - cm.gpu_pass_ms(BatchShape(num_reqs=5, decode_tokens=5)) == (
        pytest.approx(0.05 + 0.002 * 5)
    )


def test_verify_pairs_are_fitted_apart_from_the_decode_pairs():
    """The committed llama3.2-1b H100 sweeps (decode + verify width): pooled, the verify pairs
    (penalties at 4 positions of each history row) doubled the decode graph's term; apart,
    the decode term is what the decode pairs alone give, and verify steps get their own."""
    gen = Path(__file__).resolve().parents[1] / "reports/fidelity/gen"
    dec = read_sweeps([gen / "shapes-h100-llama3.2-1b.parquet"])
    both = read_sweeps([gen / "shapes-h100-llama3.2-1b.parquet",
                        gen / "shapes-h100-llama3.2-1b-spec-full.parquet"])  # fmt: skip
    alone, _ = fit_history(dec)
    model, report = fit_history(both)
    assert alone is not None and model is not None
    assert model["ms"] == alone["ms"] and model["ms_per_row"] == alone["ms_per_row"]
    assert 4e-3 < model["ms_per_row"] < 6.5e-3  # ~5.2 us a padded graph row
    assert 18e-3 < model["verify_ms_per_row"] < 30e-3  # ~24 us a history row
    assert report["verify"]["pairs"] == report["pairs"] - report["decode_pairs"] > 10
    assert "verify steps" in describe(report)


# ---- the host side of the penalties on verify steps --------------------------------------------
HOST_HIST_MS = 1.1  # sample's extra on a verify step with history rows


def _spec_run(out: Path, n_steps: int = 120) -> Path:
    """A depth-1 ngram-gpu run whose verify steps alternate between history rows and none:
    sample = 0.9 ms + 0.01 ms a request, + HOST_HIST_MS with history rows."""
    from bubblesim.core.runfmt import RunRecorder, write_run

    rng = np.random.default_rng(7)
    cfg = Config(model="tiny").replace(**{"spec.method": "ngram-gpu", "spec.k": 3})
    rec = RunRecorder()
    for i in range(8):
        rec.add_request(f"r{i}", 0.0)
    t = 0.0
    for k in range(n_steps):
        r = int(rng.integers(1, 9))
        hist = 50 * r if k % 2 else 0
        s = BatchShape(num_reqs=r, decode_tokens=r, draft_tokens=3 * r, kv_read_tokens=100 * r,
                       history_tokens=hist, context_tokens=100 * r)  # fmt: skip
        row = rec.add_step(s)
        for ph, ms in (("schedule", 0.05), ("prepare_inputs", 0.2), ("launch", 0.03),
                       ("sample", 0.9 + 0.01 * r + (HOST_HIST_MS if hist else 0.0)),
                       ("draft", 0.3)):  # fmt: skip
            rec.phase(row, ph, t, t + ms / 1e3)
            t += ms / 1e3
        rec.gpu(row, t, t + 1e-3)
        t += 1e-3
        rec.phase(row, "process_outputs", t, t + 4e-5)
        t += 4e-5
        for i in range(r):
            rec.tokens(i, t)
    for i in range(8):
        rec.finish(i, t)
    trace = {"path": "synthetic.parquet", "sha256": "0" * 64, "rows": 8}
    write_run(out, rec, config=cfg, trace=trace, source={"kind": "replay", "gpu": "NVIDIA H100"})
    return out


def test_calibrate_fits_the_verify_penalties_host_work_and_the_sim_adds_it(tmp_path: Path):
    from replay.analysis.calibrate import calibrate

    run = _spec_run(tmp_path / "spec")
    cal = calibrate([run])
    got = cal.profile["history_host"]["spec_sample_ms"]
    assert got == pytest.approx(HOST_HIST_MS, abs=1e-6)
    assert any(n.startswith("history_host.spec_sample_ms") for n in cal.notes)
    cfg = Config(model="tiny").replace(**{"spec.method": "ngram-gpu", "spec.k": 3})
    cm = CostModel(cfg, cal.profile)
    s = BatchShape(num_reqs=4, decode_tokens=4, draft_tokens=12, history_tokens=200)
    plain = BatchShape(num_reqs=4, decode_tokens=4, draft_tokens=12)
    assert cm.cpu_phase_ms("sample", s) - cm.cpu_phase_ms("sample", plain) == pytest.approx(
        HOST_HIST_MS, abs=1e-6
    )
    # x host_scale like every CPU phase; nothing without penalties or without spec decoding
    slow = CostModel(cfg.replace(host_scale=2.0), cal.profile)
    assert slow.cpu_phase_ms("sample", s) - slow.cpu_phase_ms("sample", plain) == pytest.approx(
        2 * HOST_HIST_MS, abs=1e-6
    )
    neutral = {"sampling.repetition_penalty": 1.0, "sampling.frequency_penalty": 0.0,
               "sampling.presence_penalty": 0.0}  # fmt: skip
    off = CostModel(cfg.replace(**neutral), cal.profile)
    assert off.cpu_phase_ms("sample", s) == off.cpu_phase_ms("sample", plain)
    plain_cfg = CostModel(Config(model="tiny"), cal.profile)
    d = BatchShape(num_reqs=4, decode_tokens=4, history_tokens=200)
    assert plain_cfg.cpu_phase_ms("sample", d) == plain_cfg.cpu_phase_ms(
        "sample", BatchShape(num_reqs=4, decode_tokens=4)
    )
