"""reports/fidelity/host_level.py --eager-own: the eager launch taken at a run's own level. The
median eager launch of a run folder counts eager steps only, and the profile copy moves the
eager launch's base by the factor, nothing else, so a prediction from it has that median."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.trace import make_trace, write_trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "reports/fidelity"))
import host_level  # noqa: E402


def _sim(tmp: Path, profile: Path, name: str) -> Path:
    rng = np.random.default_rng(2)
    trace = write_trace(
        make_trace(np.sort(rng.uniform(0, 1, 30)), rng.integers(20, 400, 30),
                   rng.integers(2, 40, 30)),
        tmp / "t.parquet",
    )  # fmt: skip
    out = tmp / name
    simrun.simulate(load_config(None, ["model=llama3.2-1b", f"profile={profile}"]), trace, out)
    return out


def test_eager_own_moves_the_eager_launch_median_and_nothing_else(tmp_path: Path) -> None:
    launch = {"eager_ms": 5.0, "eager_ms_per_kernel": 0.0, "graph_ms": 0.04}
    prof = {"version": 1, "launch": launch}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    base = _sim(tmp_path, path, "base")
    assert host_level.eager_launch_p50(base) == pytest.approx(5.0)
    own = host_level.own_profile(path, tmp_path / "own.json", 1.5)
    data = json.loads(own.read_text())
    assert data["launch"] == {**launch, "eager_ms": 7.5}
    assert {k: v for k, v in data.items() if k != "launch"} == {"version": 1}
    assert host_level.eager_launch_p50(_sim(tmp_path, own, "own")) == pytest.approx(7.5)


def test_a_run_without_eager_steps_has_no_median(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1}))
    out = tmp_path / "graphs"
    rng = np.random.default_rng(3)
    trace = write_trace(make_trace(np.zeros(4), rng.integers(10, 20, 4), np.full(4, 30)),
                        tmp_path / "t.parquet")  # fmt: skip
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={path}", "cuda_graphs_mixed=true"])
    simrun.simulate(cfg, trace, out)
    assert host_level.eager_launch_p50(out) is None


def test_own_shape_is_the_runs_eager_launches_over_their_mean(tmp_path: Path) -> None:
    from sim.cost.spread import check_spread, mean_ratio

    launch = {"eager_ms": 5.0, "eager_ms_per_kernel": 0.0, "graph_ms": 0.04}
    wide = {"p": [0.0, 0.5, 0.9, 1.0], "ratio": [0.8, 0.9, 1.6, 3.0]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1, "launch": launch, "cpu_spread": {"launch": wide}}))
    rng = np.random.default_rng(4)
    n = 300  # short prompts, one output token: every step an eager prefill
    trace = write_trace(make_trace(np.sort(rng.uniform(0, 30, n)), rng.integers(20, 60, n),
                                   np.ones(n, dtype=int)), tmp_path / "t.parquet")  # fmt: skip
    out = tmp_path / "run"
    simrun.simulate(load_config(None, ["model=llama3.2-1b", f"profile={path}"]), trace, out)
    shape = host_level.own_shape(out)
    assert shape is not None
    check_spread(shape)
    assert mean_ratio(shape) == pytest.approx(1.0)
    # the run's launches are 5 ms x the table's draws: the shape comes back, normalised
    r = np.interp([0.5, 0.9], shape["p"], shape["ratio"]) * mean_ratio(wide)
    assert r == pytest.approx([0.9, 1.6], rel=0.06)


def test_own_profile_puts_the_shape_where_the_simulator_reads_it(tmp_path: Path) -> None:
    shape = {"p": [0.0, 1.0], "ratio": [0.5, 1.5]}
    top = {
        "launch": {"p": [0.0, 1.0], "ratio": [1.0, 1.0]},
        "sample": {"p": [0.0, 1.0], "ratio": [0.9, 1.1]},
    }
    base = {"version": 1, "launch": {"eager_ms": 4.0}, "cpu_spread": top}
    cases = [
        ({}, lambda d: d["cpu_spread"]["launch"]),
        ({"host_speed": {"sigma": [0.1], "tau_s": [1.0]}},
         lambda d: d["host_speed"]["cpu_spread"]["launch"]),
        ({"host_speed": {"sigma": [0.1], "tau_s": [1.0], "rho": {"launch": 0.5}}},
         lambda d: d["cpu_spread"]["launch"]),
    ]  # fmt: skip
    for i, (extra, where) in enumerate(cases):
        path = tmp_path / f"p{i}.json"
        path.write_text(json.dumps({**base, **extra}))
        data = json.loads(
            host_level.own_profile(path, tmp_path / f"o{i}.json", 2.0, shape).read_text()
        )
        assert where(data) == shape
        assert data["launch"]["eager_ms"] == 8.0
        if "host_speed" in extra and "rho" not in extra["host_speed"]:
            # the other phases keep the top-level tables they were read from
            assert data["host_speed"]["cpu_spread"]["sample"] == top["sample"]
            assert data["cpu_spread"] == top


def test_seed_cells_give_the_mean_and_range_and_judge_the_mean() -> None:
    def fid(ttft: float, bubble: float) -> dict:
        return {"metrics": {"ttft_s.p50": {"rel_error": ttft},
                            "bubble_fraction": {"abs_error_points": bubble}}}  # fmt: skip

    got = host_level.seed_cells([fid(-0.04, 1.0), fid(-0.14, 2.5)])
    cells = dict(zip([c for _, c, _ in host_level.TARGETS], got, strict=True))
    assert cells["TTFT p50"] == "**-9.0 %** [-14.0, -4.0]"
    assert cells["bubble"] == "**+1.75 pt** [+1.0, +2.5]"
    assert cells["tok/s"] == "-"
    assert host_level.seed_cells([fid(-0.12, 0.0)] * 2)[3] == "-12.0 % [-12.0, -12.0]"


def test_own_states_split_the_cycle_at_the_runs_slow_share(tmp_path: Path) -> None:
    """--own-states: the copy keeps the ratio and the cycle and splits it at the share; a
    simulated run on a two-state host reads its own share back, a steady one reads none."""
    states = {"slow_over_fast": 1.8, "fast_s": 1.5, "slow_s": 0.5}
    prof = {"version": 1, "launch": {"eager_ms": 2.0, "eager_ms_per_kernel": 0.0,
                                     "graph_ms": 0.05},
            "host_speed": {"states": states}}  # fmt: skip
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    own = json.loads(host_level.own_profile(path, tmp_path / "o.json", share=0.6).read_text())
    got = own["host_speed"]["states"]
    assert got["slow_over_fast"] == 1.8
    assert got["fast_s"] == pytest.approx(0.8) and got["slow_s"] == pytest.approx(1.2)
    rng = np.random.default_rng(6)
    n = 600  # ~30 s of a CPU-bound 1b loop
    trace = write_trace(make_trace(np.sort(rng.uniform(0, 30, n)), rng.integers(20, 200, n),
                                   rng.integers(10, 60, n)), tmp_path / "t.parquet")  # fmt: skip
    run = tmp_path / "two"
    simrun.simulate(load_config(None, ["model=llama3.2-1b", f"profile={path}"]), trace, run)
    share = host_level.own_share(run, path)
    assert share is not None and 0.1 < share < 0.5  # the profile's 0.25, one run's draw
    steady = tmp_path / "steady.json"
    steady.write_text(json.dumps({k: v for k, v in prof.items() if k != "host_speed"}))
    flat = tmp_path / "flat"
    simrun.simulate(load_config(None, ["model=llama3.2-1b", f"profile={steady}"]), trace, flat)
    assert host_level.own_share(flat, steady) is None
