"""Levelling a sweep-fitted decode model to the calibration runs (replay.analysis.level): every time
in any model form scales, and the level is the runs' median measured/predicted ratio."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.runfmt import load_run
from replay.analysis.level import Curve, level_curve, level_ratio, scaled, scaled_by
from tests.helpers import mark_measured
from tests.test_sim import trace_file


def test_scaled_scales_every_form() -> None:
    model = {"max": [
        {"table": {"x": "num_tokens", "y": "kv_per_token", "xs": [1, 2], "ys": [0, 1],
                   "ms": [[1.0, 2.0], [3.0, 4.0]]}, "intercept": 0.5},
        {"spline": {"x": "num_tokens", "knots": [1, 2], "ms": [1.0, 2.0]}, "program_keys": 1e-3},
    ]}  # fmt: skip
    out = scaled(model, 2.0)
    assert out["max"][0]["table"]["ms"] == [[2.0, 4.0], [6.0, 8.0]]
    assert out["max"][0]["table"]["xs"] == [1, 2] and out["max"][0]["intercept"] == 1.0
    assert out["max"][1]["spline"]["ms"] == [2.0, 4.0] and out["max"][1]["program_keys"] == 2e-3
    assert model["max"][0]["intercept"] == 0.5  # the input is left alone


def test_level_is_the_runs_ratio(tmp_path: Path) -> None:
    n = 24
    trace = trace_file(tmp_path, "t", np.zeros(n), 200, np.full(n, 400))
    made = {"intercept": 1.3, "kv_read_tokens": 2e-5}
    (tmp_path / "p.json").write_text(json.dumps({"version": 1, "gpu_pass": {"decode": made}}))
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={tmp_path / 'p.json'}"])
    simrun.simulate(cfg, trace, tmp_path / "run")
    mark_measured(tmp_path / "run")
    run = load_run(tmp_path / "run")
    k, report = level_ratio([run], scaled(made, 1 / 1.1))  # a model 10 % low
    assert k == pytest.approx(1.1, rel=1e-6) and report["steps"] >= 200


def test_curve_interpolates_in_log_rows_and_is_flat_outside() -> None:
    c = Curve((2.0, 32.0), (1.0, 1.2))
    assert c.at(1) == 1.0 and c.at(2) == 1.0 and c.at(32) == 1.2 and c.at(500) == 1.2
    assert c.at(8) == pytest.approx(1.1)  # halfway in log2 between 2 and 32
    assert not c.is_flat_within(0.01) and Curve((4.0,), (1.005,)).is_flat_within(0.01)


def test_scaled_by_scales_each_row_count_by_its_level() -> None:
    model = {"max": [
        {"table": {"x": "num_tokens", "y": "kv_per_token", "xs": [2, 32], "ys": [0, 1],
                   "ms": [[1.0, 2.0], [3.0, 4.0]]}},
        {"spline": {"x": "num_tokens", "knots": [2, 8, 32], "ms": [1.0, 1.0, 1.0]},
         "program_keys": 1e-3},
    ]}  # fmt: skip
    out = scaled_by(model, Curve((2.0, 32.0), (1.0, 1.2)))
    assert out["max"][0]["table"]["ms"] == [[1.0, 2.0], [pytest.approx(3.6), pytest.approx(4.8)]]
    assert out["max"][1]["spline"]["ms"] == [1.0, pytest.approx(1.1), pytest.approx(1.2)]
    assert out["max"][1]["program_keys"] == pytest.approx(1.1e-3)  # the curve's median level


def test_level_curve_finds_a_level_per_batch_band(tmp_path: Path) -> None:
    """A run whose batches are 4 then 40 rows (GPU-bound: 9 ms steps, so every decode step is
    clean and queued), measured against a model 10 % low at 4 rows and 30 % low at 40: the
    curve's knots sit at 4 and 40 rows with those levels."""
    n = 44
    arrivals = np.concatenate([np.zeros(4), np.full(40, 30.0)])  # 4 alone, then 40 together
    trace = trace_file(tmp_path, "t", arrivals, 200, np.full(n, 300))
    made = {"spline": {"x": "num_tokens", "knots": [1, 4, 40, 64], "ms": [9.0, 9.0, 9.0, 9.0]}}
    (tmp_path / "p.json").write_text(json.dumps({"version": 1, "gpu_pass": {"decode": made}}))
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={tmp_path / 'p.json'}"])
    simrun.simulate(cfg, trace, tmp_path / "run")
    mark_measured(tmp_path / "run")
    run = load_run(tmp_path / "run")
    low = {"spline": {**made["spline"], "ms": [9 / 1.1, 9 / 1.1, 9 / 1.3, 9 / 1.3]}}
    curve, report = level_curve([run], low)
    assert curve is not None and [b["rows"][0] for b in report["bands"]] == [1, 32]
    assert curve.rows == (4.0, 40.0)
    assert curve.ks == (pytest.approx(1.1, rel=1e-6), pytest.approx(1.3, rel=1e-6))
