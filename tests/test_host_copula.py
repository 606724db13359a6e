"""The host speed's copula (profile key `host_speed.rho`, sim.cost.hostspeed / sim.cost.spread):
validation names the key; a phase with rho keeps its top-level table as its marginal and its
normal score correlates with the host's state at rho; rho 0 and absent phases are the
independent draws of the top-level table to the bit (a profile with `rho: {}` is the profile
without `host_speed`); a run is a function of its seed; the fast-forwards stay exact with it
on, tensor-parallel ranks included; `replay calibrate --host-copula` recovers a known rho."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from bubblesim.core.config import load_config
from bubblesim.core.phases import CPU_PHASES
from sim.cost import PROFILE_VERSION, ProfileError, validate_profile
from sim.cost.hostspeed import HostSpeed
from sim.cost.spread import PhaseSpread, phase_spread

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_and_loops, small_trace  # noqa: E402

WIDE = {"p": [0.0, 0.5, 1.0], "ratio": [0.5, 1.0, 1.5]}  # uniform on [0.5, 1.5]: u = m - 0.5
SKEW = {"p": [0.0, 0.3, 0.6, 0.9, 1.0], "ratio": [0.4, 0.6, 0.8, 1.6, 2.6]}
HOST = {"sigma": [0.2, 0.3], "tau_s": [0.02, 0.05]}
LAUNCH = CPU_PHASES.index("launch")
SAMPLE = CPU_PHASES.index("sample")


def _profile(tmp: Path, name: str = "p.json", **keys: object) -> Path:
    p = tmp / name
    p.write_text(json.dumps({"version": PROFILE_VERSION, **keys}))
    return p


@pytest.mark.parametrize(
    "rho, key",
    [
        ([0.5], "host_speed.rho"),
        ({"bogus": 0.5}, "host_speed.rho.bogus"),
        ({"launch": 1.0}, "host_speed.rho.launch"),
        ({"launch": -0.1}, "host_speed.rho.launch"),
        ({"sample": "0.5"}, "host_speed.rho.sample"),
        ({"sample": float("nan")}, "host_speed.rho.sample"),
        ({"sample": True}, "host_speed.rho.sample"),
    ],
)
def test_validation_names_the_key(rho: object, key: str) -> None:
    with pytest.raises(ProfileError, match=f"key '{key}'") as e:
        validate_profile({"version": PROFILE_VERSION, "host_speed": {**HOST, "rho": rho}})
    assert "\n" not in str(e.value)
    validate_profile({"version": PROFILE_VERSION, "host_speed": {**HOST, "rho": {"launch": 0.9}}})


def _copula_draws(rho: float, table: dict, n: int = 60_000, dt_s: float = 0.01):  # noqa: ANN202
    """(launch multipliers of steps 0 .. n - 1 at times i x dt_s, the host's z there)."""
    host = HostSpeed(HOST["sigma"], HOST["tau_s"], seed=3)
    sp = PhaseSpread({"launch": table, "sample": table}, 3, 0, host, None, {"launch": rho})
    t = np.arange(n) * dt_s
    m = np.array([sp.row_at(i, float(ti))[LAUNCH] for i, ti in enumerate(t)])
    z = np.array([host.z_at(float(ti)) for ti in t])
    return m, z, sp


@pytest.mark.parametrize("rho", [0.5, 0.9])
def test_marginal_is_the_table_and_the_score_correlates_with_the_host(rho: float) -> None:
    m, z, _ = _copula_draws(rho, SKEW)
    for q in (0.05, 0.2, 0.5, 0.75, 0.95):
        assert np.quantile(m, q) == pytest.approx(np.interp(q, SKEW["p"], SKEW["ratio"]), abs=0.04)
    assert m.mean() == pytest.approx(0.93, abs=0.02)  # the table's mean (SKEW's: 0.93)
    assert z.std() == pytest.approx(1.0, abs=0.05)  # standardised
    m, z, _ = _copula_draws(rho, WIDE)
    score = np.array([NormalDist().inv_cdf(min(max(x - 0.5, 1e-12), 1 - 1e-12)) for x in m])
    assert np.corrcoef(score, z)[0, 1] == pytest.approx(rho, abs=0.03)


def test_rho_zero_and_absent_phases_are_the_independent_draws_to_the_bit() -> None:
    """A phase at rho 0 or absent reads `row`'s draw of its table; the host's level is not
    applied (`host` None); a phase with rho > 0 reads another value, its e from the same
    uniform (so the draws stay a function of (seed, stream, phase, block))."""
    tables = {p: SKEW for p in CPU_PHASES}
    plain = PhaseSpread(tables, 7, 2)
    host = HostSpeed(HOST["sigma"], HOST["tau_s"], seed=7, stream=2)
    cop = PhaseSpread(tables, 7, 2, host, None, {"sample": 0.0, "launch": 0.8})
    assert cop.host is None and cop.state is host
    moved = 0
    for step in range(0, 3000, 7):
        t = step * 0.003
        a, b = plain.row(step), cop.row_at(step, t)
        for i in range(len(CPU_PHASES)):
            if i != LAUNCH:
                assert a[i] == b[i]
                assert cop.at_time(i, step, t) == plain.at(i, step)
        moved += a[LAUNCH] != b[LAUNCH]
        assert cop.others_max(SAMPLE, step, 3, t) == plain.others_max(SAMPLE, step, 3)
    assert moved > 400
    # rho 0 everywhere: the launch too, to the bit
    zero = PhaseSpread(tables, 7, 2, HostSpeed(HOST["sigma"], HOST["tau_s"], 7, 2), None, {})
    assert all(zero.row_at(s, s * 0.01) == list(plain.row(s)) for s in range(0, 2000, 13))


def test_other_ranks_share_the_host_state() -> None:
    """The other ranks' launches (others_max) are drawn at the same z: their largest is
    correlated with rank 0's through the host, and above rank 0's typical draw."""
    host = HostSpeed(HOST["sigma"], HOST["tau_s"], seed=1)
    sp = PhaseSpread({"launch": WIDE}, 1, 0, host, None, {"launch": 0.9})
    t = np.arange(20_000) * 0.01
    worst = np.array([sp.others_max(LAUNCH, i, 3, float(ti)) for i, ti in enumerate(t)])
    own = np.array([sp.row_at(i, float(ti))[LAUNCH] for i, ti in enumerate(t)])
    assert np.corrcoef(worst, own)[0, 1] > 0.6  # the same host, not independent draws
    # the largest of 3 correlated draws: above one draw's median, below the independent
    # largest's (0.5 ** (1/3) = 0.794: WIDE's 1.294)
    assert 1.05 < np.median(worst) < 1.29


def test_rho_empty_is_the_profile_without_host_speed(tmp_path: Path) -> None:
    """`rho: {}` draws every phase from the top-level tables and applies no host level: the
    same run, to the bit, as the profile without `host_speed`; and phase_spread reads the
    top-level tables (not `host_speed.cpu_spread`) with the key on."""
    import sim.run as simrun

    spread = {p: SKEW for p in CPU_PHASES}
    around = {p: WIDE for p in CPU_PHASES}
    a = _profile(tmp_path, "a.json", cpu_spread=spread)
    b = _profile(tmp_path, "b.json", cpu_spread=spread,
                 host_speed={**HOST, "cpu_spread": around, "rho": {}})  # fmt: skip
    trace = small_trace(tmp_path)
    recs = [
        simrun.simulate(load_config(None, ["model=llama3.2-1b", f"profile={p}", "seed=3"]), trace)
        .recorder.freeze()
        for p in (a, b)
    ]  # fmt: skip
    assert_same_records(*recs, "rho {} against no host_speed")
    sp = phase_spread(json.loads(b.read_text()), 3)
    assert sp is not None and sp.tables[LAUNCH] == SKEW and sp.host is None


def test_same_seed_same_run_and_the_copula_moves_the_phases(tmp_path: Path) -> None:
    import sim.run as simrun

    spread = {p: SKEW for p in CPU_PHASES}
    on = _profile(tmp_path, "on.json", cpu_spread=spread,
                  host_speed={**HOST, "rho": {p: 0.8 for p in CPU_PHASES}})  # fmt: skip
    off = _profile(tmp_path, "off.json", cpu_spread=spread, host_speed=HOST)
    trace = small_trace(tmp_path)

    def rec(p: Path, seed: int):  # noqa: ANN202
        sets = ["model=llama3.2-1b", f"profile={p}", f"seed={seed}"]
        return simrun.simulate(load_config(None, sets), trace).recorder.freeze()

    a, b, c, d = rec(on, 1), rec(on, 1), rec(on, 2), rec(off, 1)
    assert_same_records(a, b, "same seed")
    assert not np.array_equal(a.phase_end, c.phase_end)
    assert not np.array_equal(a.phase_end, d.phase_end)


FF_CASES = [
    ["model=llama3-8b"],
    ["model=llama3.2-1b", "batches_in_flight=1"],
    ["model=llama3-8b", "batches_in_flight=3", "cuda_graphs=false", "gc_freeze=false"],
    ["model=llama3-8b", "spec.method=ngram-gpu", "spec.k=4", "batches_in_flight=3"],
    ["model=tiny", "spec.method=ngram-cpu", "spec.k=2", "gc_freeze=false"],
    ["model=llama3-8b", "tensor_parallel_size=2"],
    ["model=llama3-8b", "tensor_parallel_size=2", "cuda_graphs_mixed=true", "batches_in_flight=1"],
]


@pytest.mark.parametrize("ranks", [False, True], ids=["others_max", "tp_ranks"])
@pytest.mark.parametrize("sets", FF_CASES, ids=lambda s: ",".join(s))
def test_fast_forward_is_exact_with_the_copula(
    tmp_path: Path, sets: list[str], ranks: bool
) -> None:
    """The step loop and the fast path draw through the one StepClock.step at the same clock
    readings: the same run to the bit, the fast path taken."""

    extra: dict[str, object] = {}
    if ranks:
        extra["tp_ranks"] = {"intercept": 0.1, "slope": -0.6, "residual": WIDE, "steps": 100}
    prof = _profile(tmp_path, cpu_spread={p: SKEW for p in CPU_PHASES},
                    host_speed={**HOST, "rho": {"launch": 0.7, "sample": 0.5,
                                                "process_outputs": 0.9}},
                    **extra)  # fmt: skip
    *recs, loops = records_and_loops(
        [*sets, f"profile={prof}", "seed=5"], small_trace(tmp_path, n=80, span_s=1.0)
    )
    assert_same_records(*recs, str(sets))
    sp = loops[1].spread
    assert sp is not None and sp.state is not None and sp.host is None
    ff = loops[1].ff
    assert ff is not None and ff.num_steps > 0  # the fast path ran, with the copula


def test_calibrate_recovers_a_known_rho(tmp_path: Path) -> None:
    """A simulated CPU-bound run whose phases follow the copula at rho 0.8 (and sample at 0):
    `calibrate(host_copula=True)` finds rho near those; without the option no `rho` is
    written."""
    import sim.run as simrun
    from replay.analysis.calibrate import calibrate

    truth = {"sigma": [0.3], "tau_s": [0.3]}
    rho = {p: 0.8 for p in CPU_PHASES if p != "sample"} | {"sample": 0.0}
    phases = {p: {"intercept": 0.15, "num_reqs": 0.002} for p in CPU_PHASES}
    prof = _profile(tmp_path, cpu_phases=phases, cpu_spread={p: WIDE for p in CPU_PHASES},
                    host_speed={**truth, "rho": rho})  # fmt: skip
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={prof}", "seed=9"])
    simrun.simulate(cfg, small_trace(tmp_path, n=500, span_s=40.0), out_dir=tmp_path / "run")
    cal = calibrate([tmp_path / "run"], host_copula=True)
    got = cal.profile["host_speed"]["rho"]
    for p in ("schedule", "launch", "process_outputs"):
        assert got[p] == pytest.approx(0.8, abs=0.15), (p, got)
    assert got["sample"] < 0.2, got
    assert "copula" in cal.host_speed
    assert "rho" not in calibrate([tmp_path / "run"]).profile["host_speed"]
    assert math.isfinite(cal.host_speed["copula"]["phases"]["launch"]["corr"])


def test_a_draw_is_a_function_of_seed_step_and_time_whatever_the_order() -> None:
    """Across a block boundary, read forward, then back by a few steps (a process_outputs),
    then by a fresh spread per read: the same values."""
    from sim.cost.spread import BLOCK_STEPS

    def make() -> PhaseSpread:
        host = HostSpeed(HOST["sigma"], HOST["tau_s"], seed=4)
        return PhaseSpread({"launch": SKEW, "process_outputs": SKEW}, 4, 0, host, None,
                           {"launch": 0.6, "process_outputs": 0.8})  # fmt: skip

    po = CPU_PHASES.index("process_outputs")
    steps = [BLOCK_STEPS - 3 + k for k in range(8)] + [BLOCK_STEPS - 2, 2 * BLOCK_STEPS + 1]
    seq = make()
    got = [(seq.row_at(s, s * 1e-3)[LAUNCH], seq.at_time(po, s, s * 1e-3 + 5e-4),
            seq.others_max(LAUNCH, s, 2, s * 1e-3)) for s in steps]  # fmt: skip
    for s, g in zip(steps, got, strict=True):
        one = make()
        assert g[0] == one.row_at(s, s * 1e-3)[LAUNCH]
        assert g[1] == make().at_time(po, s, s * 1e-3 + 5e-4)
        assert g[2] == make().others_max(LAUNCH, s, 2, s * 1e-3)
