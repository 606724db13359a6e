"""The host's two speed states (`host_speed.states`, sim.cost.hostspeed.HostStates): validation
names the key, the process spends its share of time in each state with the mean dwell times and
the multiplier's mean as `mean_over` says, whatever the order it is read in; states multiply
the processes; the fast path stays exact with them; `replay calibrate --host-states` recovers
a known two-state host from a simulated run."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import load_config
from bubblesim.core.phases import CPU_PHASES
from sim.cost import PROFILE_VERSION, ProfileError, validate_profile
from sim.cost.hostspeed import STATES_CHUNK_S, HostSpeed, HostStates, host_speed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_and_loops, small_trace  # noqa: E402

STATES = {"slow_over_fast": 1.75, "fast_s": 1.5, "slow_s": 0.75}
TABLE = {"p": [0.0, 0.5, 1.0], "ratio": [0.8, 1.0, 1.2]}


@pytest.mark.parametrize(
    "host, key",
    [
        ({"states": [1.75]}, "host_speed.states"),
        ({"states": {**STATES, "bogus": 1}}, "host_speed.states.bogus"),
        ({"states": {"fast_s": 1.0, "slow_s": 1.0}}, "host_speed.states.slow_over_fast"),
        ({"states": {**STATES, "slow_over_fast": 0.9}}, "host_speed.states.slow_over_fast"),
        ({"states": {**STATES, "fast_s": 0}}, "host_speed.states.fast_s"),
        ({"states": {**STATES, "slow_s": float("inf")}}, "host_speed.states.slow_s"),
        ({"states": STATES, "sigma": [0.1]}, "host_speed.tau_s"),
        ({"states": STATES, "rho": {"sample": 0.5}}, "host_speed.rho"),
    ],
)
def test_validation_names_the_key(host: object, key: str) -> None:
    with pytest.raises(ProfileError, match=f"key '{re.escape(key)}'"):
        validate_profile({"version": PROFILE_VERSION, "host_speed": host})


def test_states_alone_and_with_processes_are_valid() -> None:
    validate_profile({"version": PROFILE_VERSION, "host_speed": {"states": STATES}})
    both = {"states": STATES, "sigma": [0.1], "tau_s": [0.5], "mean_over": "time"}
    validate_profile({"version": PROFILE_VERSION, "host_speed": both})


@pytest.mark.parametrize("mean_over", ["steps", "time"])
def test_the_process_has_its_share_dwell_times_and_mean(mean_over: str) -> None:
    hs = HostStates(1.75, 1.5, 0.75, seed=2, mean_over=mean_over)
    t = np.arange(0.0, 6000.0, 0.005)
    m = np.array([hs.at(x) for x in t])
    fast, slow = hs.speeds
    assert slow == pytest.approx(1.75 * fast)
    assert set(np.unique(m).tolist()) == {fast, slow}
    is_slow = m == slow
    assert is_slow.mean() == pytest.approx(0.75 / 2.25, abs=0.02)
    edges = np.flatnonzero(np.diff(is_slow.astype(np.int8)))
    lengths = np.diff(edges) * 0.005
    first_slow = bool(is_slow[edges[0] + 1])  # the stretch after the first edge
    slow_len = lengths[0::2] if first_slow else lengths[1::2]
    fast_len = lengths[1::2] if first_slow else lengths[0::2]
    assert slow_len.mean() == pytest.approx(0.75, rel=0.08)
    assert fast_len.mean() == pytest.approx(1.5, rel=0.08)
    if mean_over == "steps":  # a host-bound loop's steps: 1 / mean over time of 1 / m
        assert 1 / np.mean(1 / m) == pytest.approx(1.0, abs=0.02)
    else:
        assert m.mean() == pytest.approx(1.0, abs=0.02)
    other = HostStates(1.75, 1.5, 0.75, seed=2, mean_over=mean_over)
    probe = [5000.0, 3.0, STATES_CHUNK_S * 7, 0.0, -1.0, 123.456]
    assert [other.at(p) for p in probe] == [hs.at(p) for p in probe]
    assert other.at(-1.0) == hs.at(0.0)


def test_states_multiply_the_processes() -> None:
    alone = HostSpeed([0.2], [0.5], seed=3)
    states = HostStates(2.0, 1.0, 1.0, seed=3)
    both = HostSpeed([0.2], [0.5], seed=3, states=HostStates(2.0, 1.0, 1.0, seed=3))
    for t in (0.0, 0.7, 9.3, 40.1):
        assert both.at(t) == alone.at(t) * states.at(t)
    only = host_speed({"host_speed": {"states": STATES}}, seed=3)
    assert only is not None and only.at(2.0) == HostStates(*STATES.values(), seed=3).at(2.0)
    with pytest.raises(ValueError, match="processes or states"):
        HostSpeed([], [], seed=0)


FF_CASES = [
    ["model=llama3-8b"],
    ["model=llama3.2-1b", "batches_in_flight=1"],
    ["model=llama3-8b", "spec.method=ngram-gpu", "spec.k=4", "batches_in_flight=3"],
]


@pytest.mark.parametrize("sets", FF_CASES, ids=lambda s: ",".join(s))
def test_fast_forward_is_exact_with_host_states(tmp_path: Path, sets: list[str]) -> None:
    p = tmp_path / "prof.json"
    host = {"states": {"slow_over_fast": 1.7, "fast_s": 0.2, "slow_s": 0.1}, "sigma": [0.1],
            "tau_s": [0.3], "cpu_spread": {ph: TABLE for ph in CPU_PHASES}}  # fmt: skip
    p.write_text(json.dumps({"version": PROFILE_VERSION, "host_speed": host}))
    *recs, loops = records_and_loops(
        [*sets, f"profile={p}", "seed=5"], small_trace(tmp_path, n=80, span_s=1.0)
    )
    assert_same_records(*recs, str(sets))
    assert loops[1].spread is not None and loops[1].spread.host is not None
    assert loops[1].spread.host.states is not None
    ff = loops[1].ff
    assert ff is not None and ff.num_steps > 0


def test_calibrate_recovers_a_known_two_state_host(tmp_path: Path) -> None:
    """A simulated CPU-bound run on a two-state host: --host-states finds the ratio and the
    dwell times; without it the processes alone. The 0.1 s bins blur a switch and miss the
    shortest stretches, hence the tolerances: 6 % on the ratio, 30 % on the dwell times."""
    import sim.run as simrun
    from replay.analysis.calibrate import calibrate

    truth = {"slow_over_fast": 1.8, "fast_s": 1.6, "slow_s": 0.8}
    phases = {p: {"intercept": 0.15, "num_reqs": 0.002} for p in CPU_PHASES}
    p = tmp_path / "prof.json"
    p.write_text(json.dumps({"version": PROFILE_VERSION, "cpu_phases": phases,
                             "host_speed": {"states": truth}}))  # fmt: skip
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={p}", "seed=3"])
    simrun.simulate(cfg, small_trace(tmp_path, n=3000, span_s=240.0), out_dir=tmp_path / "run")
    cal = calibrate([tmp_path / "run"], host_states=True)
    st = cal.profile["host_speed"]["states"]
    assert st["slow_over_fast"] == pytest.approx(1.8, rel=0.06)
    assert st["fast_s"] == pytest.approx(1.6, rel=0.3)
    assert st["slow_s"] == pytest.approx(0.8, rel=0.3)
    assert any(n.startswith("host_speed.states: slow") for n in cal.notes)
    assert "states" not in calibrate([tmp_path / "run"]).profile["host_speed"]
