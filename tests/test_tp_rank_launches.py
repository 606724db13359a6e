"""The measured tensor-parallel rank launches in the simulator and calibrate: profile key
`tp_ranks` (where the last worker rank's eager launch ends, fitted against rank 0's launch)
and `host_speed.mean_over` (a GPU-bound calibration's host speed has mean 1 over time).
Fitted on the llama3-70b TP4 calibration run on 4 x H100 committed in reports/tp/runs4."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import load_run
from bubblesim.core.shape import SHAPE_FIELDS
from replay.analysis.eagerlag import eager_ends, fit_eager_lag, fit_rank_launches
from replay.analysis.hostspeed import mean_over
from replay.analysis.steps import load_steps
from sim.cost import PROFILE_VERSION, ProfileError, resolve_profile, validate_profile
from sim.cost.hostspeed import HostSpeed
from sim.cost.spread import PhaseSpread
from tests.ffcheck import assert_same_records, records_without_and_with_fast_forward
from tests.test_sim import trace_file

ROOT = Path(__file__).resolve().parents[1]
CALIB = ROOT / "reports" / "tp" / "runs4" / "70b-tp4-calib70"
PROFILE = ROOT / "reports" / "tp" / "profile-h100x4-llama3-70b-tp4.json"
FLAT = {"p": [0.0, 1.0], "ratio": [1.5, 1.5]}
DOWN = {"p": [0.0, 1.0], "ratio": [2.0, 1.0]}
RANKS = {"intercept": 0.0, "slope": 0.0, "residual": FLAT}


@pytest.mark.parametrize(
    "ranks, key",
    [
        ({"slope": 0.0, "residual": FLAT}, "tp_ranks.intercept"),
        ({**RANKS, "slope": "x"}, "tp_ranks.slope"),
        ({**RANKS, "residual": DOWN}, "tp_ranks.residual.ratio[1]"),
        ({**RANKS, "bogus": 1}, "tp_ranks.bogus"),
        ({**RANKS, "steps": -1}, "tp_ranks.steps"),
    ],
)  # fmt: skip
def test_a_bad_tp_ranks_names_its_key(ranks: object, key: str) -> None:
    with pytest.raises(ProfileError, match=f"key '{re.escape(key)}'"):
        validate_profile({"version": PROFILE_VERSION, "tp_ranks": ranks})


def test_a_bad_mean_over_names_its_key() -> None:
    host = {"sigma": [0.2], "tau_s": [0.5], "mean_over": "wall"}
    with pytest.raises(ProfileError, match=re.escape("key 'host_speed.mean_over'")):
        validate_profile({"version": PROFILE_VERSION, "host_speed": host})


def test_mean_over_time_has_mean_1_over_time() -> None:
    t = np.arange(0, 400.0, 0.01)
    by_steps, by_time = HostSpeed([0.2], [0.5], 3), HostSpeed([0.2], [0.5], 3, mean_over="time")
    steps = np.array([by_steps.at(x) for x in t])
    time = np.array([by_time.at(x) for x in t])
    assert time.mean() == pytest.approx(1.0, abs=0.03)
    assert steps.mean() == pytest.approx(math.exp(0.04), abs=0.03)
    assert time * math.exp(0.04) == pytest.approx(steps)  # the same process, rescaled


def test_ranks_end_falls_with_rank_0s_launch_and_is_deterministic() -> None:
    fit = {"intercept": 0.1, "slope": -0.6, "residual": {"p": [0.0, 1.0], "ratio": [0.8, 1.2]}}
    sp, again = PhaseSpread({}, 3, ranks=fit), PhaseSpread({}, 3, ranks=fit)
    fast = np.array([sp.ranks_end(k, 0.8) for k in range(3000)])
    slow = np.array([sp.ranks_end(k, 1.5) for k in range(3000)])
    assert (fast > slow).all() and slow.min() >= math.exp(0.1) * 1.5**-0.6 * 0.8 - 1e-12
    assert [again.ranks_end(k, 0.8) for k in range(3000)] == fast.tolist()


def _profile(tmp: Path, **keys: object) -> Path:
    p = tmp / "ranks.json"
    p.write_text(json.dumps({"version": PROFILE_VERSION, "tensor_parallel_size": 4,
                             "launch": {"eager_ms": 20.0}, **keys}))  # fmt: skip
    return p


def test_a_tp_eager_pass_ends_where_the_fitted_last_rank_does(tmp_path: Path) -> None:
    """R = 1.5 always: every eager pass whose kernels end before the launch ends half a
    launch after rank 0's launch; the step loop and the fast path agree."""
    n = 24
    trace = trace_file(tmp_path, "t", np.linspace(0, 2.0, n), 300, np.full(n, 12))
    sets = ["model=llama3-8b", "gpu=h100", f"profile={_profile(tmp_path, tp_ranks=RANKS)}",
            "tensor_parallel_size=4"]  # fmt: skip
    off, on = records_without_and_with_fast_forward(sets, trace)
    assert_same_records(off, on, "tp_ranks")
    eager = np.flatnonzero(off.shape[:, SHAPE_FIELDS.index("prefill_tokens")] > 0)
    li = CPU_PHASES.index("launch")
    launch = off.phase_end[eager, li] - off.phase_start[eager, li]
    lag = off.gpu_end[eager] - off.phase_end[eager, li]
    assert lag == pytest.approx(0.5 * launch, rel=1e-9)


def test_calibrate_fits_the_measured_ranks_of_the_tp4_run() -> None:
    run = load_run(CALIB)
    prof = resolve_profile(json.loads(PROFILE.read_text()))
    steps = load_steps([run])
    ends = eager_ends([run], steps, prof)
    fit, report = fit_rank_launches(ends)
    assert fit is not None and report["n"] >= 100
    assert fit["slope"] < 0 and report["corr"] < -0.3  # rank 0 slow: often the last
    bound = ends.launch_bound()
    # the GPU ends with the last rank's launch: within a fraction of a ms of it
    after = ends.gpu_end_ms[bound] - ends.issue_end_ms()[bound]
    assert abs(float(np.median(after))) < 0.5
    lag, _ = fit_eager_lag(ends)
    assert lag is not None and lag < 1.0
    assert mean_over([run])[0] == "time"
