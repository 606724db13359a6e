"""`launch.eager_lag_ms`: an eager pass ends at the earliest that long after rank 0's launch does
(with tensor parallelism the other ranks' own eager launch: measured on 4 x H100, llama3-70b TP4
eager steps end a median 38 ms after rank 0's). The stream applies it to eager passes only, the
step loop and the fast-forwards alike, the default (0) changes nothing, and calibrate recovers
it from a run made with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import load_run
from bubblesim.core.shape import SHAPE_FIELDS
from replay.analysis.eagerlag import eager_ends, fit_eager_lag
from replay.analysis.steps import load_steps
from sim.cost import ProfileError, load_cost_model, resolve_profile
from sim.stream import gpu_pass
from tests.ffcheck import assert_same_records, records_without_and_with_fast_forward
from tests.helpers import mark_measured
from tests.test_sim import trace_file


def test_the_lag_holds_eager_passes_only() -> None:
    # eager: kernels from the launch's start (1.0), the launch ends at 2.0, kernels take 0.5
    assert gpu_pass(1.0, 2.0, 0.0, 0.5, False) == (1.0, 2.0)
    assert gpu_pass(1.0, 2.0, 0.0, 0.5, False, eager_lag_s=0.25) == (1.0, 2.25)
    # kernels past the lagged launch end: the kernels decide
    assert gpu_pass(1.0, 2.0, 0.0, 1.5, False, eager_lag_s=0.25) == (1.0, 2.5)
    # a graph is one issue: no lag
    assert gpu_pass(1.0, 2.0, 0.0, 0.5, True, eager_lag_s=0.25) == (2.0, 2.5)


def _profile(tmp: Path, lag: float | None) -> Path:
    la = {} if lag is None else {"eager_lag_ms": lag}
    p = tmp / f"lag{lag}.json"
    p.write_text(json.dumps({"version": 1, "launch": la}))
    return p


@pytest.mark.parametrize("depth", [1, 2])
def test_the_step_loop_and_fast_forward_apply_it_alike(tmp_path: Path, depth: int) -> None:
    n = 16
    trace = trace_file(tmp_path, "t", np.linspace(0, 0.5, n), 300, np.full(n, 40))
    base = ["model=llama3.2-1b", "gpu=h100", f"batches_in_flight={depth}"]
    off, on = records_without_and_with_fast_forward([*base, f"profile={_profile(tmp_path, 4)}"],
                                                    trace)  # fmt: skip
    assert_same_records(off, on, f"depth {depth}")
    none, _ = records_without_and_with_fast_forward(base, trace)
    zero, _ = records_without_and_with_fast_forward(
        [*base, f"profile={_profile(tmp_path, 0.0)}"], trace
    )
    assert_same_records(none, zero, "a zero lag is no lag")
    # eager (prefill) steps end >= 4 ms after their launch; the run takes longer
    assert np.nansum(off.gpu_end - off.gpu_start) > np.nansum(none.gpu_end - none.gpu_start)


def test_a_negative_lag_is_refused(tmp_path: Path) -> None:
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={_profile(tmp_path, -1.0)}"])
    with pytest.raises(ProfileError, match=r"launch\.eager_lag_ms"):
        load_cost_model(cfg)


def test_calibrate_recovers_the_lag(tmp_path: Path) -> None:
    """A run made with a known lag (as a measured run: its summary says replay) gives it back
    from the GPU model it was made with."""
    n = 40
    trace = trace_file(tmp_path, "t", np.linspace(0, 1.0, n), 200, np.full(n, 20))
    made = {"version": 1, "launch": {"eager_lag_ms": 6.0, "eager_ms": 2.0}}
    (tmp_path / "p.json").write_text(json.dumps(made))
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={tmp_path / 'p.json'}"])
    simrun.simulate(cfg, trace, tmp_path / "run")
    mark_measured(tmp_path / "run")
    run = load_run(tmp_path / "run")
    lag, report = fit_eager_lag(
        eager_ends([run], load_steps([run]), resolve_profile({"version": 1}))
    )
    assert report["launch_bound"] >= 20 and lag == pytest.approx(6.0, rel=1e-3)


SPREAD = {"p": [0.0, 0.5, 0.9, 1.0], "ratio": [0.6, 0.9, 1.6, 3.0]}


def test_other_ranks_draw_their_own_launch(tmp_path: Path) -> None:
    from sim.cost.spread import PhaseSpread

    sp = PhaseSpread({"launch": SPREAD}, seed=3)
    li = CPU_PHASES.index("launch")
    own = np.array([sp.at(li, k) for k in range(2000)])
    one = np.array([sp.others_max(li, k, 1) for k in range(2000)])
    three = np.array([sp.others_max(li, k, 3) for k in range(2000)])
    assert not np.array_equal(own, one)  # another stream
    assert (one >= 0.6).all() and (three <= 3.0).all()
    assert three.mean() > one.mean() > 0.9  # the last of three ranks comes later
    again = PhaseSpread({"launch": SPREAD}, seed=3)
    assert [again.others_max(li, k, 3) for k in range(2000)] == three.tolist()


def _spread_profile(tmp: Path) -> Path:
    p = tmp / "spread.json"
    p.write_text(json.dumps({"version": 1, "launch": {"eager_ms": 20.0},
                             "cpu_spread": {"launch": SPREAD}}))  # fmt: skip
    return p


def test_a_tensor_parallel_eager_step_waits_for_the_last_rank(tmp_path: Path) -> None:
    """With a launch spread, a TP eager pass ends after rank 0's launch whenever another rank
    drew a longer one; one GPU: no lag. Deterministic, and the fast path agrees."""
    n = 24
    trace = trace_file(tmp_path, "t", np.linspace(0, 2.0, n), 300, np.full(n, 12))
    base = ["model=llama3-8b", "gpu=h100", f"profile={_spread_profile(tmp_path)}"]
    lags = {}
    for tp in (1, 2, 4):
        sets = [*base, f"tensor_parallel_size={tp}"]
        off, on = records_without_and_with_fast_forward(sets, trace)
        assert_same_records(off, on, f"tp {tp}")
        again, _ = records_without_and_with_fast_forward(sets, trace)
        assert_same_records(off, again, f"tp {tp} twice")
        eager = np.flatnonzero(off.shape[:, SHAPE_FIELDS.index("prefill_tokens")] > 0)
        launch_end = off.phase_end[eager, CPU_PHASES.index("launch")]
        lags[tp] = float(np.mean(off.gpu_end[eager] - launch_end))
    assert lags[1] == pytest.approx(0.0, abs=2e-3)  # kernels of a 300-token prefill: ~ms
    assert lags[4] > lags[2] > lags[1] + 1e-3
