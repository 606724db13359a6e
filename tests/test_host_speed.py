"""The host's slowly varying speed (profile key `host_speed`, sim.cost.hostspeed): validation
names the key, the process has the fitted variance and correlation time whatever the order it
is read in, the phases take it on top of the spread, a run is a function of its seed, the
fast-forwards stay exact with it on, it is off without the key, and `replay calibrate`
recovers a known process from a simulated run."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import load_config
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.shape import BatchShape
from sim.cost import PROFILE_VERSION, CostModel, ProfileError, validate_profile
from sim.cost.hostspeed import CHUNK, GRID_S, HostSpeed
from sim.cost.spread import PhaseSpread, phase_spread

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_and_loops, small_trace  # noqa: E402

TABLE = {"p": [0.0, 0.5, 1.0], "ratio": [0.7, 1.0, 1.3]}  # mean 1
HOST = {"sigma": [0.1, 0.3], "tau_s": [0.05, 0.4]}
SAMPLE = {"intercept": 0.07, "num_reqs": 0.002}


def _profile(tmp: Path, **keys: object) -> Path:
    p = tmp / "host.json"
    p.write_text(json.dumps({"version": PROFILE_VERSION, **keys}))
    return p


@pytest.mark.parametrize(
    "host, key",
    [
        ([0.1], "host_speed"),
        ({"tau_s": [1.0]}, "host_speed.sigma"),
        ({"sigma": [0.1]}, "host_speed.tau_s"),
        ({**HOST, "bogus": 1}, "host_speed.bogus"),
        ({"sigma": [0.1, -0.2], "tau_s": [1, 1]}, "host_speed.sigma[1]"),
        ({"sigma": [0.1], "tau_s": [0]}, "host_speed.tau_s[0]"),
        ({"sigma": [0.1, 0.2], "tau_s": [1.0]}, "host_speed.tau_s"),
        ({"sigma": [], "tau_s": []}, "host_speed.sigma"),
        ({**HOST, "cpu_spread": {"bogus": TABLE}}, "host_speed.cpu_spread.bogus"),
        ({**HOST, "cpu_spread": {"sample": {"p": [0, 1]}}}, "host_speed.cpu_spread.sample.ratio"),
    ],
)
def test_validation_names_the_key(host: object, key: str) -> None:
    with pytest.raises(ProfileError, match=f"key '{re.escape(key)}'"):
        validate_profile({"version": PROFILE_VERSION, "host_speed": host})


def test_process_has_its_variance_and_correlation_whatever_the_order() -> None:
    """Mean 1 over a host-bound loop's steps (1 / mean of 1 / m over time), log sd and
    autocorrelation of a sum of OU processes; reading the times out of order (a jump back to
    an earlier chunk, another instance) gives the same values."""
    hs = HostSpeed([0.2], [0.5], seed=3)
    t = np.arange(0, 400.0, 0.01)
    m = np.array([hs.at(x) for x in t])
    assert 1 / np.mean(1 / m) == pytest.approx(1.0, abs=0.03)
    assert m.mean() == pytest.approx(math.exp(0.04), abs=0.03)
    x = np.log(m)
    assert x.std() == pytest.approx(0.2, rel=0.1)
    lag = int(0.5 / 0.01)
    xc = x - x.mean()
    acf = float(np.mean(xc[:-lag] * xc[lag:]) / np.mean(xc * xc))
    assert acf == pytest.approx(math.exp(-1), abs=0.08)
    other = HostSpeed([0.2], [0.5], seed=3)
    probe = [250.0, 3.0, CHUNK * GRID_S * 7 + 0.001, 0.0, 123.456]
    assert [other.at(p) for p in probe] == [hs.at(p) for p in probe]
    assert HostSpeed([0.2], [0.5], seed=4).at(1.0) != hs.at(1.0)
    assert HostSpeed([0.2], [0.5], seed=3, stream=1).at(1.0) != hs.at(1.0)


def test_chunks_are_the_point_by_point_recursion_to_the_bit() -> None:
    """A chunk is drawn one component at a time and summed in component order: the same
    float operations as stepping every component at each grid point, so the same values."""
    sigma, tau = [0.25, 0.2, 0.05], [0.1, 2.5, 0.01]
    hs = HostSpeed(sigma, tau, seed=7, mean_over="time")
    got = [[hs.at((c * CHUNK + k + 0.5) * GRID_S) for k in range(CHUNK)] for c in (0, 1, 2)]
    eps_rng = [np.random.default_rng([7, 0, 0x4853, c]) for c in (0, 1, 2)]
    x: list[float] = []
    for c, rng in enumerate(eps_rng):
        eps = rng.standard_normal((len(sigma), CHUNK + 1))
        if c == 0:
            x = [sg * float(e[0]) for sg, e in zip(sigma, eps, strict=True)]
        want = []
        for k in range(CHUNK):
            tot = 0.0
            for j in range(len(sigma)):
                x[j] = hs.a[j] * x[j] + hs.b[j] * float(eps[j, k + 1])
                tot += x[j]
            want.append(math.exp(tot + hs.half_var))
        assert got[c] == want


def test_phases_take_the_speed_on_top_of_the_spread(tmp_path: Path) -> None:
    """Each step's sample phase is the linear model x the spread around the speed (the
    host_speed's own table, not the top-level one) x the speed at the step's start."""
    import sim.run as simrun

    wide = {"p": [0.0, 1.0], "ratio": [0.0, 2.0]}  # the top-level table: must not be used
    prof = _profile(tmp_path, cpu_phases={"sample": SAMPLE}, cpu_spread={"sample": wide},
                    host_speed={**HOST, "cpu_spread": {"sample": TABLE}})  # fmt: skip
    sets = ["model=llama3.2-1b", f"profile={prof}", "seed=4"]
    rec = simrun.simulate(load_config(None, sets), small_trace(tmp_path)).recorder.freeze()
    j = CPU_PHASES.index("sample")
    cost = CostModel(load_config(None, sets), json.loads(prof.read_text()))
    dur = (rec.phase_end[:, j] - rec.phase_start[:, j]) * 1e3
    pred = np.array([cost.cpu_phase_ms("sample", BatchShape(*r)) for r in rec.shape.tolist()])
    spread = PhaseSpread({"sample": TABLE}, seed=4)
    host = HostSpeed(HOST["sigma"], HOST["tau_s"], seed=4)
    t0 = rec.phase_start[:, CPU_PHASES.index("schedule")]
    want = [spread.at(j, k) * host.at(t) for k, t in enumerate(t0.tolist())]
    np.testing.assert_allclose(dur / pred, want, rtol=1e-9)
    assert len(dur) > 1000


def test_off_without_the_key_and_same_seed_same_run(tmp_path: Path) -> None:
    import sim.run as simrun

    assert phase_spread({"cpu_spread": {}}, 0) is None
    sp = phase_spread({"cpu_spread": {"sample": TABLE}}, 0)
    assert sp is not None and sp.host is None
    prof = _profile(tmp_path, host_speed=HOST)
    base = ["model=llama3.2-1b", f"profile={prof}"]
    trace = small_trace(tmp_path)
    a = simrun.simulate(load_config(None, [*base, "seed=1"]), trace).recorder.freeze()
    b = simrun.simulate(load_config(None, [*base, "seed=1"]), trace).recorder.freeze()
    c = simrun.simulate(load_config(None, [*base, "seed=2"]), trace).recorder.freeze()
    assert_same_records(a, b, "same seed")
    assert not np.array_equal(a.phase_end, c.phase_end)


FF_CASES = [
    ["model=llama3-8b"],
    ["model=llama3.2-1b", "batches_in_flight=1"],
    ["model=llama3-8b", "batches_in_flight=3", "cuda_graphs=false", "gc_freeze=false"],
    ["model=llama3-8b", "num_kv_blocks=300", "max_num_seqs=16"],
    ["model=llama3.2-1b", "spec.method=ngram-gpu", "spec.k=2", "batches_in_flight=1"],
    ["model=llama3-8b", "spec.method=ngram-gpu", "spec.k=4", "batches_in_flight=3"],
    ["model=tiny", "spec.method=ngram-cpu", "spec.k=2", "gc_freeze=false"],
    ["model=llama3-8b", "spec.method=ngram-gpu", "optimistic_spec_decode=false"],
]


@pytest.mark.parametrize("sets", FF_CASES, ids=lambda s: ",".join(s))
def test_fast_forward_is_exact_with_a_host_speed(tmp_path: Path, sets: list[str]) -> None:
    """The step loop and the fast path read the speed through the one StepClock.step, at the
    same clock readings: the same run to the bit (the fast path does not step aside)."""

    prof = _profile(tmp_path, host_speed={**HOST, "cpu_spread": {p: TABLE for p in CPU_PHASES}})
    *recs, loops = records_and_loops(
        [*sets, f"profile={prof}", "seed=5"], small_trace(tmp_path, n=80, span_s=1.0)
    )
    assert_same_records(*recs, str(sets))
    assert loops[1].spread is not None and loops[1].spread.host is not None
    ff = loops[1].ff
    assert ff is not None and ff.num_steps > 0  # the fast path ran, with the host speed


def test_calibrate_recovers_a_known_host_speed(tmp_path: Path) -> None:
    """A simulated CPU-bound run with a known slow process on every phase: calibrate's fit
    finds its variance and correlation time (the slow component), and the spread around it
    is narrower than the spread that ignores it."""
    import sim.run as simrun
    from replay.analysis.calibrate import calibrate

    truth = {"sigma": [0.25], "tau_s": [0.3]}
    phases = {p: {"intercept": 0.15, "num_reqs": 0.002} for p in CPU_PHASES}
    prof = _profile(tmp_path, cpu_phases=phases,
                    host_speed={**truth, "cpu_spread": {p: TABLE for p in CPU_PHASES}})  # fmt: skip
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={prof}", "seed=9"])
    simrun.simulate(cfg, small_trace(tmp_path, n=500, span_s=40.0), out_dir=tmp_path / "run")
    cal = calibrate([tmp_path / "run"])
    hs = cal.profile["host_speed"]
    var = sum(s * s for s in hs["sigma"])
    assert math.sqrt(var) == pytest.approx(0.25, rel=0.3)
    slow = max(range(len(hs["tau_s"])), key=lambda i: hs["sigma"][i])
    assert hs["tau_s"][slow] == pytest.approx(0.3, rel=0.5)
    j = "sample"
    around, plain = hs["cpu_spread"][j], cal.profile["cpu_spread"][j]
    iqr = [np.interp(0.9, t["p"], t["ratio"]) - np.interp(0.1, t["p"], t["ratio"])
           for t in (around, plain)]  # fmt: skip
    assert iqr[0] < iqr[1]
    assert "host_speed" not in calibrate([tmp_path / "run"], host_speed=False).profile


def test_fit_ou_recovers_two_time_scales() -> None:
    """The autocovariance of a sum of two OU processes (lags >= 1 bin): both components,
    within the grid's resolution; one that fits no positive variance is left out."""
    from replay.analysis.hostspeed import BIN_S, fit_ou

    lag = np.arange(81) * BIN_S
    cov = 0.02 * np.exp(-lag / 0.15) + 0.01 * np.exp(-lag / 2.0)
    cov[0] += 0.01  # the steps' own noise: lag 0 only
    got = fit_ou(cov, np.full(81, 500.0), BIN_S)
    assert len(got) == 2
    (s1, t1), (s2, t2) = sorted(got, key=lambda c: c[1])
    assert (s1**2, t1) == (pytest.approx(0.02, rel=0.05), pytest.approx(0.15, rel=0.05))
    assert (s2**2, t2) == (pytest.approx(0.01, rel=0.05), pytest.approx(2.0, rel=0.05))
    assert fit_ou(-np.abs(cov), np.full(81, 500.0), BIN_S) == []
