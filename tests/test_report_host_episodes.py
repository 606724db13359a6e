"""reports/fidelity/host_episodes.py: a run's host wander, read from a simulated run whose host
speed process is known: none gives a steady host, a slow process a wandering one."""

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
from host_episodes import BINS_S, predicted, wander  # noqa: E402

BASE = {"version": 1, "launch": {"eager_ms": 2.0, "eager_ms_per_kernel": 0.0, "graph_ms": 0.05}}


def _run(tmp: Path, prof: dict, name: str) -> tuple[dict, Path]:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(prof))
    rng = np.random.default_rng(6)
    n = 400  # ~20 s of Poisson arrivals, short prompts and outputs: a CPU-bound 1b loop
    trace = write_trace(make_trace(np.sort(rng.uniform(0, 20, n)), rng.integers(20, 200, n),
                                   rng.integers(10, 60, n)), tmp / f"{name}.parquet")  # fmt: skip
    out = tmp / name
    simrun.simulate(load_config(None, ["model=llama3.2-1b", f"profile={path}"]), trace, out)
    return resolve_profile(load_profile(path)), out


def test_a_slow_host_process_shows_as_wander_and_none_as_a_steady_host(tmp_path: Path) -> None:
    steady_prof, steady = _run(tmp_path, BASE, "steady")
    level, sds = wander(steady_prof, steady)
    assert abs(level - 1.0) < 1e-6  # no spread, no host process: the run is its own model
    assert len(sds) == len(BINS_S) and max(sds) < 1e-6
    slow = {**BASE, "host_speed": {"sigma": [0.3], "tau_s": [2.0]}}
    slow_prof, wandering = _run(tmp_path, slow, "wandering")
    _, sds = wander(slow_prof, wandering)
    assert sds[-1] > 0.1  # 1 s bins of a 0.3-sd process with a 2 s memory
    # --predicted reads a run's seeded predictions where host_level.py leaves them
    (tmp_path / "work").mkdir()
    wandering.rename(tmp_path / "work" / "sim-x-host-eager")
    got = predicted(slow_prof, tmp_path / "work", "x")
    assert got.endswith("(1)") and float(got.split()[0]) > 0.1
    assert predicted(slow_prof, tmp_path / "work", "y") == "- (none)"
