"""The CPU phases' measured spread (profile key `cpu_spread`, sim.cost.spread): validation names
the key, the multipliers follow the table, a run is a function of its seed, the fast-forwards
stay exact with a spread, and `replay calibrate` recovers a known spread from a run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import load_config
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.shape import BatchShape
from sim.cost import PROFILE_VERSION, CostModel, ProfileError, validate_profile
from sim.cost.spread import BLOCK_STEPS, PhaseSpread, mean_ratio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_and_loops, small_trace  # noqa: E402

# a skewed table with a heavy tail (1 % of steps 2-6x), mean 1
RAW = {"p": [0.0, 0.25, 0.5, 0.9, 0.99, 1.0], "ratio": [0.5, 0.8, 0.9, 1.3, 2.0, 6.0]}
TABLE = {"p": RAW["p"], "ratio": [r / mean_ratio(RAW) for r in RAW["ratio"]]}
SAMPLE = {"intercept": 0.07, "num_reqs": 0.002}  # terms the calibration fits (PHASE_TERMS)


def _profile(tmp: Path, spread: dict[str, object], **more: object) -> Path:
    p = tmp / "spread.json"
    p.write_text(json.dumps({"version": PROFILE_VERSION, "cpu_spread": spread, **more}))
    return p


@pytest.mark.parametrize(
    "spread, key",
    [
        ({"bogus": TABLE}, "cpu_spread.bogus"),
        ({"sample": {"p": [0.1, 1.0], "ratio": [1, 1]}}, "cpu_spread.sample.p"),
        ({"sample": {"p": [0, 0.5, 0.5, 1], "ratio": [1, 1, 1, 1]}}, "cpu_spread.sample.p[2]"),
        ({"sample": {"p": [0, 0.5, 1], "ratio": [1, 2, 1.5]}}, "cpu_spread.sample.ratio[2]"),
        ({"sample": {"p": [0, 0.5, 1], "ratio": [1, 2]}}, "cpu_spread.sample.ratio"),
        ({"sample": {"p": [0, 1], "ratio": [-1, 2]}}, "cpu_spread.sample.ratio[0]"),
        ({"sample": {"p": [0, "x", 1], "ratio": [1, 1, 1]}}, "cpu_spread.sample.p[1]"),
        ({"sample": {**TABLE, "sigma": 0.3}}, "cpu_spread.sample.sigma"),
        ({"sample": {"p": [0, 1]}}, "cpu_spread.sample.ratio"),
        ({"sample": [1, 2]}, "cpu_spread.sample"),
    ],
)
def test_validation_names_the_key(spread: dict[str, object], key: str) -> None:
    with pytest.raises(ProfileError, match=f"key '{__import__('re').escape(key)}'"):
        validate_profile({"version": PROFILE_VERSION, "cpu_spread": spread})


def test_multipliers_follow_the_table_whatever_the_order() -> None:
    sp = PhaseSpread({"sample": TABLE}, seed=3)
    i = CPU_PHASES.index("sample")
    n = 3 * BLOCK_STEPS
    sp.ensure(0, n - 1)
    m = np.array(sp.window[i][:n])
    p = np.array([0.1, 0.5, 0.9, 0.95, 0.99, 0.995])
    want = np.interp(p, TABLE["p"], TABLE["ratio"])
    np.testing.assert_allclose(np.quantile(m, p), want, rtol=0.03)
    assert m.mean() == pytest.approx(1.0, rel=0.01)
    assert sp.window[CPU_PHASES.index("draft")][:n] == [1.0] * n  # no table: 1
    # a value is a function of (seed, stream, phase, step) only: the window's moves don't matter
    other = PhaseSpread({"sample": TABLE}, seed=3)
    for step in (2 * BLOCK_STEPS + 5, 7, BLOCK_STEPS - 1, 5 * BLOCK_STEPS):
        assert other.at(i, step) == (m[step] if step < n else sp.at(i, step))
    assert PhaseSpread({"sample": TABLE}, seed=3, stream=1).at(i, 7) != m[7]
    # `row` (a step's every multiplier in one call, sim.clock) is `at` for each phase
    rows = PhaseSpread({"sample": TABLE, "schedule": TABLE}, seed=3)
    ats = PhaseSpread({"sample": TABLE, "schedule": TABLE}, seed=3)
    for step in (0, 5, BLOCK_STEPS - 1, BLOCK_STEPS, 2 * BLOCK_STEPS + 9, 7):
        assert rows.row(step) == tuple(ats.at(j, step) for j in range(len(CPU_PHASES)))


def _sim(tmp: Path, sets: list[str]):
    import sim.run as simrun

    cfg = load_config(None, sets)
    return simrun.simulate(cfg, small_trace(tmp))


def test_phase_times_follow_the_table(tmp_path: Path) -> None:
    """Each step's sample phase is the linear model's time x the step's multiplier; over the
    run the ratios have the table's quantiles."""
    prof = _profile(tmp_path, {"sample": TABLE}, cpu_phases={"sample": SAMPLE})
    sets = ["model=llama3.2-1b", f"profile={prof}", "seed=4"]
    res = _sim(tmp_path, sets)
    rec = res.recorder.freeze()
    j = CPU_PHASES.index("sample")
    cost = CostModel(load_config(None, sets), json.loads(prof.read_text()))
    dur = (rec.phase_end[:, j] - rec.phase_start[:, j]) * 1e3
    pred = np.array([cost.cpu_phase_ms("sample", BatchShape(*r)) for r in rec.shape.tolist()])
    ratio = dur / pred
    spread = PhaseSpread({"sample": TABLE}, seed=4)
    want = np.array([spread.at(j, k) for k in range(len(ratio))])
    np.testing.assert_allclose(ratio, want, rtol=1e-9)
    assert len(ratio) > 1000
    p = np.array([0.25, 0.5, 0.9])
    np.testing.assert_allclose(
        np.quantile(ratio, p), np.interp(p, TABLE["p"], TABLE["ratio"]), rtol=0.06
    )
    # the other phases have no table: their times are the linear model's
    k = CPU_PHASES.index("schedule")
    got = (rec.phase_end[:, k] - rec.phase_start[:, k]) * 1e3
    want_s = [cost.cpu_phase_ms("schedule", BatchShape(*r)) for r in rec.shape.tolist()]
    np.testing.assert_allclose(got[np.array(want_s) > 0], np.array(want_s)[np.array(want_s) > 0],
                               rtol=1e-6)  # fmt: skip


def test_same_seed_same_run_other_seed_differs(tmp_path: Path) -> None:
    prof = _profile(tmp_path, {p: TABLE for p in CPU_PHASES})
    base = ["model=llama3.2-1b", f"profile={prof}"]
    a = _sim(tmp_path, [*base, "seed=1"]).recorder.freeze()
    b = _sim(tmp_path, [*base, "seed=1"]).recorder.freeze()
    c = _sim(tmp_path, [*base, "seed=2"]).recorder.freeze()
    assert_same_records(a, b, "same seed")
    assert not np.array_equal(a.phase_end, c.phase_end)


def test_no_spread_by_default(tmp_path: Path) -> None:
    *_, loops = records_and_loops(["model=llama3.2-1b"], small_trace(tmp_path))
    assert loops and all(lp.spread is None for lp in loops)


FF_CASES = [
    ["model=llama3-8b"],
    ["model=llama3-8b", "batches_in_flight=1"],
    ["model=llama3-8b", "batches_in_flight=3", "cuda_graphs=false", "gc_freeze=false"],
    ["model=llama3-8b", "num_kv_blocks=300", "max_num_seqs=16"],
    ["model=llama3-8b", "spec.method=ngram-gpu"],
    ["model=llama3.2-1b", "spec.method=ngram-gpu", "spec.k=2", "batches_in_flight=1"],
    ["model=llama3-8b", "spec.method=ngram-gpu", "spec.k=4", "batches_in_flight=3"],
    ["model=tiny", "spec.method=ngram-cpu", "spec.k=2", "gc_freeze=false"],
    ["model=llama3-8b", "spec.method=ngram-gpu", "optimistic_spec_decode=false"],
]


@pytest.mark.parametrize("sets", FF_CASES, ids=lambda s: ",".join(s))
def test_fast_forward_is_exact_with_a_spread(tmp_path: Path, sets: list[str]) -> None:
    prof = _profile(tmp_path, {p: TABLE for p in CPU_PHASES})
    *recs, loops = records_and_loops(
        [*sets, f"profile={prof}", "seed=5"], small_trace(tmp_path, n=80, span_s=1.0)
    )
    assert_same_records(*recs, str(sets))
    ff = loops[1].ff
    assert ff is not None and ff.num_steps > 0  # the fast path ran, with the spread


def test_calibrate_recovers_a_known_spread(tmp_path: Path) -> None:
    """A simulated run with a known sample-phase spread: the fit's table has its quantiles."""
    import sim.run as simrun
    from replay.analysis.calibrate import calibrate

    prof = _profile(tmp_path, {"sample": TABLE}, cpu_phases={"sample": SAMPLE})
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={prof}", "seed=9"])
    simrun.simulate(cfg, small_trace(tmp_path, n=120, span_s=3.0), out_dir=tmp_path / "run")
    cal = calibrate([tmp_path / "run"])
    got = cal.profile["cpu_spread"]["sample"]
    p = np.array([0.1, 0.25, 0.5, 0.75, 0.9, 0.95])
    np.testing.assert_allclose(
        np.interp(p, got["p"], got["ratio"]), np.interp(p, TABLE["p"], TABLE["ratio"]), rtol=0.05
    )
    assert mean_ratio(got) == pytest.approx(1.0, abs=1e-4)
    rep = cal.spread["sample"]
    assert rep["n"] > 1000 and rep["ratio_weighted_mean"] == pytest.approx(1.0, abs=0.03)
