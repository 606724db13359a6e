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
from replay.analysis.level import level_ratio, scaled
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
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    summary["source"]["kind"] = "replay"  # as if measured
    (tmp_path / "run" / "summary.json").write_text(json.dumps(summary))
    run = load_run(tmp_path / "run")
    k, report = level_ratio([run], scaled(made, 1 / 1.1))  # a model 10 % low
    assert k == pytest.approx(1.1, rel=1e-6) and report["steps"] >= 200
