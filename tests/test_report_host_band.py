"""reports/fidelity/host_band.py and sim.hostband: the two states' scales under the profile's
normalisation, the steady copy the band is predicted from, the band's verdict widened by each
target, and `sim run --host-band` end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reports" / "fidelity"))
from host_band import band_cell, steady_profile  # noqa: E402

from sim.hostband import state_scales  # noqa: E402

STATES = {"slow_over_fast": 1.75, "fast_s": 1.5, "slow_s": 0.75}


@pytest.mark.parametrize("mean_over", ["steps", "time"])
def test_scales_are_the_simulators_two_speeds(mean_over: str) -> None:
    fast, slow = state_scales({"states": STATES, "mean_over": mean_over})
    assert slow / fast == pytest.approx(1.75)  # the normalisation below is HostStates' own
    share = 0.75 / 2.25
    if mean_over == "steps":  # a host-bound loop's steps keep the profile's mean
        assert (1 - share) / fast + share / slow == pytest.approx(1.0)
    else:
        assert (1 - share) * fast + share * slow == pytest.approx(1.0)


def test_steady_copy_drops_the_host_and_keeps_its_spread(tmp_path: Path) -> None:
    table = {"p": [0.0, 1.0], "ratio": [0.9, 1.1]}
    prof = {"version": 1, "cpu_spread": {"sample": {"p": [0.0, 1.0], "ratio": [0.0, 2.0]}},
            "host_speed": {"states": STATES, "sigma": [0.1], "tau_s": [0.5],
                           "cpu_spread": {"sample": table}}}  # fmt: skip
    src = tmp_path / "p.json"
    src.write_text(json.dumps(prof))
    out, fast, slow = steady_profile(src, tmp_path / "s.json")
    data = json.loads(out.read_text())
    assert "host_speed" not in data and data["cpu_spread"] == {"sample": table}
    assert slow / fast == pytest.approx(1.75)
    src.write_text(json.dumps({"version": 1, "host_speed": {"sigma": [0.1], "tau_s": [0.5]}}))
    with pytest.raises(SystemExit, match="no host_speed.states"):
        steady_profile(src, tmp_path / "t.json")


def test_band_cell_widens_the_band_by_the_target() -> None:
    assert band_cell("tpot_s.p50", 2.0, 1.8, 2.2) == ("IN", True)
    assert band_cell("tpot_s.p50", 2.0, 2.2, 1.8) == ("IN", True)  # either order
    assert band_cell("tpot_s.p50", 2.3, 1.8, 2.2) == ("in (+4.5 %)", True)  # 5 % target
    assert band_cell("tpot_s.p50", 2.4, 1.8, 2.2) == ("+9.1 %", False)
    assert band_cell("ttft_s.p50", 1.5, 1.6, 3.0) == ("in (-6.3 %)", True)  # 10 % target
    assert band_cell("output_tok_per_s", 96.0, 100.0, 100.0) == ("-4.0 %", False)  # 3 %


def test_sim_run_host_band(tmp_path: Path) -> None:
    """The run folder is the profile's own prediction; summary.json gets the band, a CPU-bound
    1b loop's TPOT p50 slower on the slow host; a profile without states is one error."""
    import numpy as np

    from bubblesim.core.cli import run_main
    from bubblesim.core.trace import make_trace, write_trace
    from sim.__main__ import main

    prof = {"version": 1, "cpu_phases": {"sample": {"intercept": 3.0}},  # CPU-bound
            "host_speed": {"states": STATES}}  # fmt: skip
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    rng = np.random.default_rng(1)
    trace = write_trace(make_trace(np.sort(rng.uniform(0, 5, 100)), rng.integers(20, 200, 100),
                                   rng.integers(10, 60, 100)), tmp_path / "t.parquet")  # fmt: skip
    out = tmp_path / "run"
    sets = ["--set", "model=llama3.2-1b", "--set", f"profile={path}"]
    assert main(["run", str(trace), *sets, "--host-band", "-q", "-o", str(out)]) == 0
    band = json.loads((out / "summary.json").read_text())["host_band"]
    fast, slow = band["fast"], band["slow"]
    assert slow["host_scale"] / fast["host_scale"] == pytest.approx(1.75)
    assert slow["metrics"]["tpot_s.p50"] > fast["metrics"]["tpot_s.p50"]
    path.write_text(json.dumps({"version": 1}))
    with pytest.raises(SystemExit) as e:  # one line, exit 2, nothing written
        run_main(main, ["run", str(trace), *sets, "--host-band", "-q", "-o", str(tmp_path / "no")])
    assert e.value.code == 2 and not (tmp_path / "no").exists()
