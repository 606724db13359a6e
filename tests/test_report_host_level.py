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
    own = host_level.eager_own_profile(path, 1.5, tmp_path / "own.json")
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
