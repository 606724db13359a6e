"""Taking requests in (profile key `intake`, sim.loop.SimLoop.intake): the host's time between
the last CPU phase and the next schedule when requests arrived, in no phase, as the engine's
record shows it; fitted by replay.analysis.intake from those gaps. The fast paths take arrivals
through the same call, so runs with them on and off stay the same (to 1e-9), behind a router
too; a profile without the key predicts what it did before."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import bubblesim.plan.fleet as fleet
import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import load_run
from bubblesim.core.trace import make_trace, write_trace
from bubblesim.plan.fleet import FleetSpec, simulate_fleet
from replay.analysis.intake import fit_intake, intake_rows
from sim.loop import SimLoop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_without_and_with_fast_forward  # noqa: E402

INTAKE = {"ms": 0.2, "ms_per_request": 0.07, "wake_ms": 0.3}


def _trace(tmp: Path, n: int = 120, span_s: float = 3.0, seed: int = 3) -> Path:
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0, span_s, n))
    arrival[10:16] = arrival[10]  # a burst: several requests at one loop top
    t = make_trace(arrival, rng.integers(20, 600, n), rng.integers(5, 120, n))
    return write_trace(t, tmp / "t.parquet")


def _profile(tmp: Path, intake: dict[str, float] | None) -> Path:
    prof: dict[str, object] = {"version": 1}
    if intake is not None:
        prof["intake"] = intake
    path = tmp / f"p{len(list(tmp.glob('p*.json')))}.json"
    path.write_text(json.dumps(prof))
    return path


def _run(tmp: Path, trace: Path, sets: list[str], name: str) -> Path:
    out = tmp / name
    simrun.simulate(load_config(None, sets), trace, out)
    return out


def _gaps(run_dir: Path, slept: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(requests, gap ms) of the busy loop tops (or of those after an idle sleep)."""
    n, g, asleep = intake_rows(load_run(run_dir))
    return n[asleep == slept], g[asleep == slept]


@pytest.mark.parametrize(
    "sets",
    [
        ["model=llama3.2-1b"],
        ["model=llama3.2-1b", "batches_in_flight=1"],
        ["model=llama3-8b", "batches_in_flight=3", "num_kv_blocks=300"],
        ["model=llama3-8b", "spec.method=ngram-gpu"],
        ["model=llama3-8b", "spec.method=ngram-cpu"],
    ],
)
def test_fast_paths_stay_exact_with_intake(tmp_path: Path, sets: list[str]) -> None:
    trace = _trace(tmp_path)
    sets = [*sets, f"profile={_profile(tmp_path, INTAKE)}"]
    assert_same_records(*records_without_and_with_fast_forward(sets, trace), str(sets))


def test_behind_a_router_the_intake_is_charged_and_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    trace = make_trace(np.sort(rng.uniform(0, 2, 80)), rng.integers(20, 500, 80),
                       rng.integers(1, 100, 80))  # fmt: skip
    outs = {}
    for intake in (None, INTAKE):
        cfg = load_config(None, [f"profile={_profile(tmp_path, intake)}", "gc_freeze=false"])
        for ff in (False, True):
            orig = fleet.SimLoop
            fleet.SimLoop = functools.partial(SimLoop, fast_forward=ff)  # type: ignore[misc]
            try:
                res = simulate_fleet(FleetSpec(cfg, 2, "least-outstanding"), trace)
            finally:
                fleet.SimLoop = orig  # type: ignore[misc]
            res.pop("sim")
            outs[(intake is not None, ff)] = res
    assert outs[(True, False)] == outs[(True, True)]
    assert outs[(False, False)] == outs[(False, True)]
    assert outs[(True, False)] != outs[(False, False)], "the intake changed nothing"


def test_the_intake_is_a_gap_before_the_schedule_and_fits_back(tmp_path: Path) -> None:
    """A simulated run's gaps are the profile's cost to the bit; the fit (which reads measured
    runs only) gives the two numbers back when the run is labelled measured."""
    trace = _trace(tmp_path)
    sets = ["model=llama3.2-1b", "gc_freeze=false"]
    base = _run(tmp_path, trace, [*sets, f"profile={_profile(tmp_path, None)}"], "base")
    on = _run(tmp_path, trace, [*sets, f"profile={_profile(tmp_path, INTAKE)}"], "on")
    n0, g0 = _gaps(base)
    n1, g1 = _gaps(on)
    assert n1.size > 30 and (n1 > 1).any()
    assert np.all(g0 < 1e-9)  # no intake: the schedule starts where the last phase ends
    expect = INTAKE["ms"] + INTAKE["ms_per_request"] * n1
    np.testing.assert_allclose(g1, expect, rtol=1e-6, atol=1e-9)
    # after an idle sleep: the wake, then the intake of everything due by then
    ns, gs = _gaps(on, slept=True)
    assert ns.size >= 3
    wake = INTAKE["wake_ms"] + INTAKE["ms"] + INTAKE["ms_per_request"] * ns
    np.testing.assert_allclose(gs, wake, rtol=1e-6, atol=1e-9)
    # the same time stays in no CPU phase
    s0, s1 = load_run(base).arrays("steps"), load_run(on).arrays("steps")
    for p in CPU_PHASES:
        d0 = np.nansum(s0[f"{p}_end_s"] - s0[f"{p}_start_s"])
        d1 = np.nansum(s1[f"{p}_end_s"] - s1[f"{p}_start_s"])
        assert d1 == pytest.approx(d0, rel=0.05), p
    run = load_run(on)
    run.summary["source"] = {"kind": "replay"}
    table, report = fit_intake([run])
    assert table is not None
    assert table["ms"] == pytest.approx(INTAKE["ms"], abs=1e-6)
    assert table["ms_per_request"] == pytest.approx(INTAKE["ms_per_request"], abs=1e-6)
    assert table["wake_ms"] == pytest.approx(INTAKE["wake_ms"], abs=1e-6)
    assert report["tops"] == n1.size and report["wakes"] == ns.size


def test_too_few_tops_keep_the_base_and_sim_runs_are_not_fitted(tmp_path: Path) -> None:
    trace = _trace(tmp_path, n=12)
    on = _run(tmp_path, trace, [f"profile={_profile(tmp_path, INTAKE)}"], "on")
    run = load_run(on)
    assert fit_intake([run])[0] is None and fit_intake([run])[1]["tops"] == 0
    run.summary["source"] = {"kind": "replay"}
    table, report = fit_intake([run])
    assert table is None and "not fitted" in report["note"]


def test_host_scale_scales_the_intake(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    prof = _profile(tmp_path, INTAKE)
    sets = ["model=llama3.2-1b", "gc_freeze=false", f"profile={prof}"]
    out = _run(tmp_path, trace, [*sets, "host_scale=2"], "x2")
    n, g = _gaps(out)
    np.testing.assert_allclose(g, 2 * (INTAKE["ms"] + INTAKE["ms_per_request"] * n), rtol=1e-6)
    # the wake is the OS's timer, not the host's Python: not scaled
    ns, gs = _gaps(out, slept=True)
    wake = INTAKE["wake_ms"] + 2 * (INTAKE["ms"] + INTAKE["ms_per_request"] * ns)
    np.testing.assert_allclose(gs, wake, rtol=1e-6)


def test_an_idle_loop_takes_near_simultaneous_arrivals_together(tmp_path: Path) -> None:
    """Requests 10 us apart reaching an idle engine: with a wake of 0.3 ms they share one
    prefill step, as the engine's sleep overshoot lets them; without, the first goes alone."""
    arrival = np.array([1.0, 1.00001, 1.00002, 2.0, 2.00001])
    trace = write_trace(make_trace(arrival, np.full(5, 64), np.full(5, 4)), tmp_path / "b.parquet")
    counts = {}
    for wake in (0.0, 0.3):
        prof = _profile(tmp_path, {"ms": 0.0, "ms_per_request": 0.0, "wake_ms": wake})
        out = _run(tmp_path, trace, ["model=llama3.2-1b", f"profile={prof}"], f"w{wake}")
        s = load_run(out).arrays("steps")
        counts[wake] = s["num_prefill_reqs"][s["prefill_tokens"] > 0].tolist()
    assert counts[0.3] == [3, 2]
    assert counts[0.0][0] == 1 and len(counts[0.0]) > 2


def test_a_bad_intake_value_is_named(tmp_path: Path) -> None:
    from sim.cost.profile import ProfileError, load_profile

    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"version": 1, "intake": {"ms": "fast"}}))
    with pytest.raises(ProfileError, match="intake"):
        load_profile(path)
