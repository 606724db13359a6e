"""`BatchShape.max_kv_tokens` (the longest context attention reads in a step), end to end:
the scheduler's `shape`, the fast path (sim/fast/decode.py, sim/fast/spec.py,
sim/fast/specstep.py) that build shapes without it, cost models that read it, and run folders
written before the field existed (read as zeros, named in `Run.filled`)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.policy import Entry, Scheduler
from bubblesim.core.request import Request
from bubblesim.core.runfmt import Recording, RunRecorder, load_run
from bubblesim.core.runfmt.tables import STEP_COLUMNS
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape
from bubblesim.core.trace import make_trace, write_trace
from replay.analysis.calibrate import calibrate
from replay.analysis.compare import compare_runs
from replay.analysis.steps import load_steps
from sim.cost import LINEAR_TERMS, compile_linear, design_row, save_profile, validate_profile
from sim.loop import SimLoop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_without_and_with_fast_forward  # noqa: E402

MAX_KV = SHAPE_FIELDS.index("max_kv_tokens")


def test_the_field_sits_after_attn_pairs() -> None:
    i = SHAPE_FIELDS.index("attn_pairs")
    assert SHAPE_FIELDS[i + 1] == "max_kv_tokens"
    assert STEP_COLUMNS[STEP_COLUMNS.index("attn_pairs") + 1] == "max_kv_tokens"
    assert "max_kv_tokens" in LINEAR_TERMS


def test_scheduler_shape_takes_the_longest_context() -> None:
    reqs = [Request(i, i, 0.0, p, 50) for i, p in enumerate((900, 30, 4000, 120))]
    entries = [
        Entry(reqs[0], 0, 512, 0, False, True),  # a prompt chunk: reads 512
        Entry(reqs[1], 40, 3, 2, True, False),  # a decode with 2 drafts: reads 43
        Entry(reqs[2], 3999, 1, 0, True, False),  # the longest: 4000
        Entry(reqs[3], 100, 20, 0, True, True),  # the rest of a prompt: 120
    ]
    s = Scheduler.shape(entries)
    assert s.max_kv_tokens == 4000
    assert s.kv_read_tokens == 512 + 43 + 4000 + 120
    assert Scheduler.shape(entries[:2]).max_kv_tokens == 512
    assert Scheduler.shape([]).max_kv_tokens == 0


def test_linear_models_and_profiles_take_the_term(tmp_path: Path) -> None:
    model = {"intercept": 1.0, "kv_read_tokens": 2e-5, "max_kv_tokens": 1e-3}
    validate_profile({"version": 1, "gpu_pass": {"decode": model}})
    validate_profile({"version": 1, "cpu_phases": {"prepare_inputs": {"max_kv_tokens": 1e-6}}})
    s = BatchShape(num_reqs=2, decode_tokens=2, kv_read_tokens=5000, max_kv_tokens=4000)
    assert compile_linear(model)(s) == pytest.approx(1.0 + 0.1 + 4.0)
    assert design_row(s, ["max_kv_tokens", "intercept"]) == [4000.0, 1.0]


# ---- the fast-forwards against the step loop ----------------------------------------------------
def _mixed_trace(tmp: Path, seed: int) -> Path:
    """A few long prompts with short outputs among short prompts with long outputs: the longest
    context finishes (and the batch's longest drops) while the rest keep decoding."""
    rng = np.random.default_rng(seed)
    n = 50
    long = np.arange(n) % 7 == 3
    prompt = np.where(long, rng.integers(3000, 6000, n), rng.integers(20, 300, n))
    output = np.where(long, rng.integers(10, 60, n), rng.integers(60, 300, n))
    rate = rng.uniform(0.05, 0.4, n).astype(np.float32)  # low: most drafts are rejected
    t = make_trace(np.sort(rng.uniform(0, 4, n)), prompt, output, accept_rate=rate)
    return write_trace(t, tmp / f"mixed{seed}.parquet")


def _simulate(sets: list[str], trace: Path, ff: bool) -> tuple[Recording, list[int], list]:
    """(the recording, each step's longest context taken from the scheduled entries (step
    loop), the (first step, count) of each bulk append (fast-forward))."""
    longest: list[int] = []
    bulk: list[tuple[int, int]] = []
    schedule, add_steps = Scheduler.schedule, RunRecorder.add_steps

    def spy_schedule(self: Scheduler):  # type: ignore[no-untyped-def]
        batch = schedule(self)
        if batch is not None:
            longest.append(max(e.start_pos + e.num_tokens for e in batch.entries))
        return batch

    def spy_add_steps(self: RunRecorder, shapes, phases=None):  # type: ignore[no-untyped-def]
        s0 = add_steps(self, shapes, phases)
        bulk.append((s0, len(shapes)))
        return s0

    orig = simrun.SimLoop
    simrun.SimLoop = functools.partial(SimLoop, fast_forward=ff)  # type: ignore[misc]
    Scheduler.schedule = spy_schedule  # type: ignore[method-assign]
    RunRecorder.add_steps = spy_add_steps  # type: ignore[method-assign]
    try:
        rec = simrun.simulate(load_config(None, sets), trace).recorder.freeze()
    finally:
        simrun.SimLoop = orig  # type: ignore[misc]
        Scheduler.schedule = schedule  # type: ignore[method-assign]
        RunRecorder.add_steps = add_steps  # type: ignore[method-assign]
    return rec, longest, bulk


SETS = [
    ["model=llama3-8b"],
    ["model=llama3-8b", "batches_in_flight=3", "block_size=8"],
    ["model=llama3.2-1b", "spec.method=ngram-gpu", "spec.k=4"],
    ["model=llama3-8b", "spec.method=ngram-cpu", "spec.k=3", "batches_in_flight=1"],
    ["model=llama3-8b", "spec.method=ngram-gpu", "spec.k=2", "batches_in_flight=3"],
]


@pytest.mark.parametrize("sets", SETS, ids=[" ".join(s) for s in SETS])
def test_fast_forwarded_steps_have_the_step_loops_longest_context(
    tmp_path: Path, sets: list[str]
) -> None:
    trace = _mixed_trace(tmp_path, 3)
    rec, longest, _ = _simulate(sets, trace, ff=False)
    step = rec.shape
    assert step[:, MAX_KV].tolist() == longest  # the recorded field is the entries' max
    ff, _, bulk = _simulate(sets, trace, ff=True)
    np.testing.assert_array_equal(ff.shape, step)  # every field, max_kv_tokens included
    np.testing.assert_array_equal(ff.gpu_end, rec.gpu_end)
    # inside the bulk-computed steps: a decode step after which the longest context left
    drops = 0
    for s0, n in bulk:
        rows = ff.shape[s0 : s0 + n]
        decode = rows[:, SHAPE_FIELDS.index("num_prefill_reqs")] == 0
        fell = np.diff(rows[:, MAX_KV]) < 0
        drops += int((fell & decode[:-1] & decode[1:]).sum())
    assert sum(n for _, n in bulk) > len(step) // 2, "fast-forward barely ran"
    assert drops > 0, "no fast-forwarded step where the longest context dropped"
    if any(s.startswith("spec.") for s in sets):  # rejected drafts' KV was given back
        drafted = step[:, SHAPE_FIELDS.index("draft_tokens")].sum()
        assert 0 < rec.accepted.sum() < drafted / 2


@pytest.mark.parametrize("spec", ["none", "ngram-gpu"])
def test_costs_read_the_fast_forwards_longest_context(tmp_path: Path, spec: str) -> None:
    """A profile whose GPU pass and a CPU phase follow max_kv_tokens: the fast-forwards hand the
    varying value to the cost functions each step, so the runs stay equal to the bit, and the
    term does move them."""
    term = {"intercept": 4.0, "num_tokens": 0.004, "kv_read_tokens": 2e-5}
    prof = {
        "version": 1,
        "gpu_pass": {"decode": {**term, "max_kv_tokens": 2e-3}},
        "cpu_phases": {"prepare_inputs": {"intercept": 0.2, "max_kv_tokens": 4e-4}},
    }
    base = {"version": 1, "gpu_pass": {"decode": term}}
    trace = _mixed_trace(tmp_path, 4)
    outs = {}
    for name, p in (("term", prof), ("base", base)):
        path = save_profile(tmp_path / f"{name}.json", p)
        sets = ["model=llama3-8b", f"spec.method={spec}", f"profile={path}"]
        outs[name] = records_without_and_with_fast_forward(sets, trace)
        assert_same_records(*outs[name], name)
    assert not np.array_equal(outs["term"][1].gpu_end, outs["base"][1].gpu_end)


# ---- run folders written before the field -------------------------------------------------------
def _strip(run: Path) -> None:
    """Make `run` look written before max_kv_tokens existed."""
    t = pq.read_table(run / "steps.parquet")
    pq.write_table(t.drop_columns(["max_kv_tokens"]), run / "steps.parquet")


def test_old_runs_read_the_field_as_zeros_and_name_it(tmp_path: Path) -> None:
    trace = _mixed_trace(tmp_path, 5)
    new, old = tmp_path / "new", tmp_path / "old"
    cfg = load_config(None, ["model=llama3-8b"])
    simrun.simulate(cfg, trace, new)
    simrun.simulate(cfg, trace, old)
    _strip(old)
    a, b = load_run(new), load_run(old)
    assert a.filled == () and b.filled == ("max_kv_tokens",)
    assert tuple(b.steps.column_names) == STEP_COLUMNS == tuple(a.steps.column_names)
    assert (b.arrays("steps")["max_kv_tokens"] == 0).all()
    assert (a.arrays("steps")["max_kv_tokens"] > 0).all()
    for f in STEP_COLUMNS:
        if f != "max_kv_tokens":
            assert a.steps.column(f).equals(b.steps.column(f)), f
    # the same batches: an old measured run still lines up with a new prediction
    fid = compare_runs(a, b)
    assert fid["steps"]["fraction_identical"] == 1.0
    assert "max_kv_tokens" not in fid["steps"]["mismatched_steps_by_field"]
    assert len(load_steps([a, b])) == 2 * a.steps.num_rows


def test_calibrate_accepts_old_runs(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_replay import synthetic_run

    runs = [synthetic_run(tmp_path / f"r{i}", seed=i, n_req=30) for i in range(2)]
    before = calibrate(runs).profile
    _strip(runs[0])
    assert load_run(runs[0]).filled == ("max_kv_tokens",)
    cal = calibrate(runs)
    assert json.dumps(cal.profile, sort_keys=True) == json.dumps(before, sort_keys=True)
    # zeros are not measurements: the GPU fits leave the term out, and say so
    assert any("max_kv_tokens" in n and "left out" in n for n in cal.notes)
    assert not any("max_kv_tokens" in n for n in calibrate(runs[1:]).notes)


@pytest.mark.parametrize("method", ["ngram-gpu", "ngram-cpu"])
def test_fused_spec_steps_behind_a_router_take_the_longest_context(method: str) -> None:
    """Replicas fed by a router run no segments: their spec steps are sim/fast/specstep.py's."""
    import bubblesim.plan.fleet as fleet
    from bubblesim.plan.fleet import FleetSpec, simulate_fleet

    rng = np.random.default_rng(9)
    n = 60
    long = np.arange(n) % 6 == 1
    trace = make_trace(
        np.sort(rng.uniform(0, 3, n)),
        np.where(long, rng.integers(3000, 6000, n), rng.integers(20, 300, n)),
        np.where(long, rng.integers(10, 60, n), rng.integers(60, 250, n)),
    )
    spec = FleetSpec(load_config(None, [f"spec.method={method}", "num_kv_blocks=2000"]), 2,
                     "least-outstanding")  # fmt: skip
    shapes = []
    for ff in (False, True):
        loops: list[SimLoop] = []
        orig = fleet.SimLoop
        fleet.SimLoop = functools.partial(_keep, loops, fast_forward=ff)  # type: ignore[misc]
        try:
            simulate_fleet(spec, trace)
        finally:
            fleet.SimLoop = orig  # type: ignore[misc]
        shapes.append([lp.rec.freeze().shape for lp in loops])
        if ff:
            assert sum(lp.spec_steps.num_fast for lp in loops if lp.spec_steps) > 0
    for a, b in zip(*shapes, strict=True):
        np.testing.assert_array_equal(a, b)
        assert (np.diff(a[:, MAX_KV]) < 0).any()


def _keep(loops: list[SimLoop], *args: object, **kw: object) -> SimLoop:
    loop = SimLoop(*args, **kw)  # type: ignore[arg-type]
    loops.append(loop)
    return loop
