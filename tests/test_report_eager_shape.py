"""reports/fidelity/eager_shape.py: a run's eager launches and their shape, on simulated runs
whose launch spread table is known."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.trace import make_trace, write_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reports" / "fidelity"))
from eager_shape import eager_launch_ms, shape_line  # noqa: E402


def _run(tmp: Path, spread: dict | None, name: str) -> Path:
    prof: dict = {
        "version": 1,
        "launch": {"eager_ms": 4.0, "eager_ms_per_kernel": 0.0, "graph_ms": 0.02},
    }
    if spread is not None:
        prof["cpu_spread"] = {"launch": spread}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(prof))
    rng = np.random.default_rng(5)
    n = 200  # one output token each: every request is an eager prefill step
    trace = write_trace(make_trace(np.sort(rng.uniform(0, 20, n)), rng.integers(20, 60, n),
                                   np.ones(n, dtype=int)), tmp / f"{name}.parquet")  # fmt: skip
    out = tmp / name
    simrun.simulate(load_config(None, ["model=llama3.2-1b", f"profile={path}"]), trace, out)
    return out


def test_eager_launches_are_the_eager_steps_and_their_shape_is_the_tables(
    tmp_path: Path,
) -> None:
    flat = eager_launch_ms(_run(tmp_path, None, "flat"))
    assert flat.size >= 150 and flat == pytest.approx(4.0)
    assert "mean/median 1.00, p10 1.00 p25 1.00 p75 1.00 p90 1.00; p10 4.00 ms" in shape_line(
        "x", flat
    )
    tail = {"p": [0.0, 0.5, 0.9, 1.0], "ratio": [0.9, 1.0, 2.0, 2.0]}
    y = eager_launch_ms(_run(tmp_path, tail, "tail"))
    line = shape_line("tail", y)
    assert line.startswith(f"tail: n {y.size}, median ")
    p90 = float(line.split("p90 ")[1].split(";")[0])
    assert line.endswith(" ms") and "; p10 " in line
    assert p90 == pytest.approx(2.0, abs=0.15)  # the table's p90 over its p50
    assert shape_line("none", np.array([])) == "none: no eager launch"
