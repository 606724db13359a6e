"""A decode graph issued to an idle GPU runs `gpu_pass.idle_start.scale` x its time (measured
on an H100: 20-40 % faster than one queued behind the previous step). The step loop and the
fast-forwards apply it identically; the default (1.0) changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import load_config
from sim.cost import ProfileError, load_cost_model
from sim.stream import gpu_pass
from tests.ffcheck import assert_same_records, records_without_and_with_fast_forward
from tests.test_sim import trace_file


def test_gpu_pass_scales_only_graphs_that_start_on_an_idle_gpu() -> None:
    # idle for 1 ms before the graph is issued: scaled
    assert gpu_pass(0.0, 2.0, 1.0, 1.0, True, 0.5, 1e-4) == (2.0, 2.5)
    # queued behind the previous pass: full time
    assert gpu_pass(0.0, 2.0, 3.0, 1.0, True, 0.5, 1e-4) == (3.0, 4.0)
    # idle for less than the threshold: full time
    assert gpu_pass(0.0, 2.0, 2.0 - 5e-5, 1.0, True, 0.5, 1e-4) == (2.0, 3.0)
    # eager passes are not graphs: unchanged
    assert gpu_pass(0.0, 2.0, 1.0, 1.0, False, 0.5, 1e-4) == (1.0, 2.0)


def _profile(tmp: Path, scale: float) -> Path:
    p = tmp / f"idle{scale}.json"
    p.write_text(json.dumps({"version": 1, "gpu_pass": {"idle_start": {"scale": scale}}}))
    return p


@pytest.mark.parametrize("depth", [1, 2])
def test_fast_forward_applies_the_idle_scale_like_the_step_loop(tmp_path: Path, depth: int):
    n = 24
    trace = trace_file(
        tmp_path, "t", np.linspace(0, 2.0, n), 200, np.full(n, 120)
    )  # a CPU-bound small model: depth 1 idles the GPU between steps
    sets = [
        "model=llama3.2-1b", "gpu=h100", f"batches_in_flight={depth}",
        f"profile={_profile(tmp_path, 0.6)}",
    ]  # fmt: skip
    off, on = records_without_and_with_fast_forward(sets, trace)
    assert_same_records(off, on, f"depth {depth}")
    if depth == 1:  # synchronous: every decode graph starts on an idle GPU
        base, _ = records_without_and_with_fast_forward(sets[:-1], trace)
        busy = np.nansum(off.gpu_end - off.gpu_start)
        assert busy < 0.9 * np.nansum(base.gpu_end - base.gpu_start)


def test_idle_scale_is_validated(tmp_path: Path) -> None:
    cfg = load_config(None, ["model=llama3.2-1b", f"profile={_profile(tmp_path, 1.5)}"])
    with pytest.raises(ProfileError, match=r"gpu_pass\.idle_start\.scale"):
        load_cost_model(cfg)
    cfg = load_config(None, ["model=llama3.2-1b"])
    assert load_cost_model(cfg).idle_start_scale == 1.0


def test_calibrate_recovers_the_idle_scale(tmp_path: Path) -> None:
    """A run made with scale 0.6 (as a measured run: its summary says replay) gives back 0.6
    from the decode model it was made with."""
    import sim.run as simrun
    from bubblesim.core.runfmt import load_run
    from replay.analysis.idle_start import fit_idle_start

    n = 40
    trace = trace_file(tmp_path, "t", np.linspace(0, 2.0, n), 200, np.full(n, 80))
    decode = {"intercept": 1.2, "kv_read_tokens": 2e-5}
    made = {"version": 1, "gpu_pass": {"decode": decode, "idle_start": {"scale": 0.6}}}
    (tmp_path / "p.json").write_text(json.dumps(made))
    cfg = load_config(None, ["model=llama3.2-1b", "batches_in_flight=1",
                             f"profile={tmp_path / 'p.json'}"])  # fmt: skip
    simrun.simulate(cfg, trace, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    summary["source"]["kind"] = "replay"
    (tmp_path / "run" / "summary.json").write_text(json.dumps(summary))
    fit_with = {"version": 1, "gpu_pass": {"decode": decode}}
    table, report = fit_idle_start([load_run(tmp_path / "run")], fit_with)
    assert table is not None and report["steps"] >= 30
    assert table["scale"] == pytest.approx(0.6, abs=0.01)
