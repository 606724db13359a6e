"""reports/fidelity/phase_rows.py: each CPU phase's measured time over a profile's, by band of
decode rows. A simulated run read against the profile it ran with reads 1 in every band; against
a profile whose per-row cost is twice the run's, the ratio falls band by band, as an
extrapolated per-row cost does on a measured run (reports/fidelity/README.md section N)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.trace import make_trace, write_trace
from sim.cost.profile import load_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reports" / "fidelity"))
from phase_rows import EDGES, PHASES, ratios  # noqa: E402

PHASE_MODELS = {
    "schedule": {"intercept": 0.02, "num_reqs": 0.002},
    "prepare_inputs": {"intercept": 0.1, "num_reqs": 0.003},
    "sample": {"intercept": 0.08, "num_reqs": 0.0005},
    "process_outputs": {"intercept": 0.015, "num_reqs": 0.002},
}


def _profile(path: Path, per_row_scale: float = 1.0) -> dict:
    phases = {p: {"intercept": m["intercept"], "num_reqs": m["num_reqs"] * per_row_scale}
              for p, m in PHASE_MODELS.items()}  # fmt: skip
    path.write_text(json.dumps({"version": 1, "cpu_phases": phases}))
    return load_profile(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("phase_rows")
    _profile(tmp / "prof.json")
    rng = np.random.default_rng(4)
    n = 300  # queued within a second: the batch fills past 128 rows and drains
    trace = write_trace(make_trace(np.sort(rng.uniform(0, 1, n)), rng.integers(20, 200, n),
                                   rng.integers(20, 400, n)), tmp / "t.parquet")  # fmt: skip
    cfg = load_config(None, ["model=llama3.2-1b", "gpu=h100", f"profile={tmp / 'prof.json'}"])
    simrun.simulate(cfg, trace, tmp / "run")
    return tmp, tmp / "run"


def test_a_run_reads_one_against_its_own_profile(run: tuple[Path, Path]) -> None:
    tmp, out = run
    cells = ratios(out, _profile(tmp / "same.json"), EDGES)
    assert set(cells) == set(PHASES)
    filled = [c for p in PHASES for c in cells[p] if c is not None]
    assert len(filled) >= 4 * 5  # the run reaches five of the six bands at least
    assert filled == pytest.approx([1.0] * len(filled), rel=1e-6)


def test_an_overstated_per_row_cost_reads_falling_band_by_band(run: tuple[Path, Path]) -> None:
    tmp, out = run
    cells = ratios(out, _profile(tmp / "double.json", per_row_scale=2.0), EDGES)
    for phase in PHASES:
        got = [c for c in cells[phase] if c is not None]
        assert all(a > b for a, b in zip(got, got[1:])), (phase, got)
        assert got[-1] < min(0.85, got[0] - 0.15), (phase, got)
