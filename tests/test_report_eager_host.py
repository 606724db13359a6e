"""reports/fidelity/eager_host.py: the eager launch's elasticity to the host's speed. The IV
estimate recovers a floor's share where OLS on a noisy speed estimate is attenuated; on a
simulated run, whose launches the host's speed scales whole, it reads the windows' small bias
above 1, and relative to the graphed steps' own (rel) it reads 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.trace import make_trace, write_trace
from sim.cost.profile import load_profile, resolve_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reports" / "fidelity"))
from eager_host import eager_host, elasticities, pooled_rel, side_means  # noqa: E402


def test_side_means_split_the_window_at_the_launch() -> None:
    t = np.array([0.0, 0.05, 0.1, 0.2, 0.3])
    v = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    before, after, nb, na = side_means(t, v, np.array([0.1]), 0.1)
    assert nb.tolist() == [2] and na.tolist() == [1]  # 0.0, 0.05 | 0.2 (0.1 on neither side)
    assert before.tolist() == [1.5] and after.tolist() == [4.0]


def test_iv_recovers_a_floor_that_ols_on_a_noisy_speed_understates() -> None:
    rng = np.random.default_rng(3)
    log_h = rng.normal(0.0, 0.3, 20_000)  # the host's state at each launch
    floor, excess = 2.0, 6.0  # ms: a floor the speed does not scale, and an excess it does
    launch = (floor + excess * np.exp(log_h)) * np.exp(rng.normal(0, 0.05, log_h.size))
    before = log_h + rng.normal(0, 0.2, log_h.size)  # two estimates, independent noise
    after = log_h + rng.normal(0, 0.2, log_h.size)
    ols, iv = elasticities(np.log(launch), before, after)
    # d log launch / d log h at the typical state: the excess's share, ~excess / (floor + excess)
    share = excess / (floor + excess)
    assert abs(iv - share) < 0.04
    assert ols < iv - 0.04  # attenuated by the estimate's noise
    # a launch the speed scales whole: elasticity 1
    _, iv1 = elasticities(log_h + rng.normal(0, 0.05, log_h.size), before, after)
    assert abs(iv1 - 1.0) < 0.05


def test_a_simulated_run_reads_elasticity_one(tmp_path: Path) -> None:
    prof = {"version": 1, "launch": {"eager_ms": 2.0, "eager_ms_per_kernel": 0.0,
                                     "graph_ms": 0.05},
            "host_speed": {"sigma": [0.3], "tau_s": [2.0]}}  # fmt: skip
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(prof))
    rng = np.random.default_rng(6)
    n = 400
    trace = write_trace(make_trace(np.sort(rng.uniform(0, 20, n)), rng.integers(20, 200, n),
                                   rng.integers(10, 60, n)), tmp_path / "t.parquet")  # fmt: skip
    out = tmp_path / "run"
    simrun.simulate(load_config(None, ["model=llama3.2-1b", f"profile={path}"]), trace, out)
    r = eager_host(resolve_profile(load_profile(path)), out)
    assert r is not None and r.n >= 30
    assert r.iv > 1.02  # the windows reach the host away from the launch: IV reads above 1
    assert abs(r.rel - 1.0) < 0.05 and r.rel_lo <= 1.0 <= r.rel_hi  # relative to the steps'
    assert abs(r.launch_per_speed_ms - 2.0) < 0.2  # the profile's launch at speed 1
    assert pooled_rel([r, r]) == r.rel
