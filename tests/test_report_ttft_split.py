"""reports/fidelity/ttft_split.py: a run's time to first token split at each request's prefill
step; the parts add up to the TTFT, on a simulated run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.runfmt import load_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reports" / "fidelity"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sim_max_kv import _mixed_trace  # noqa: E402
from ttft_split import line, split  # noqa: E402


def test_the_parts_add_up_to_the_ttft(tmp_path: Path) -> None:
    trace = _mixed_trace(tmp_path, 3)
    simrun.simulate(load_config(None, ["model=llama3-8b", "gpu=h100"]), trace, tmp_path / "run")
    parts = split(tmp_path / "run")
    n = len(parts["ttft"])
    assert n > 10 and all(len(v) == n for v in parts.values())
    total = parts["queue"] + parts["launch"] + parts["sample"] + parts["after"]
    np.testing.assert_allclose(total, parts["ttft"], rtol=0, atol=1e-9)
    assert (parts["queue"] >= 0).all() and (parts["launch"] > 0).all()
    # the step found is the request's prefill: its sample ends before the first token, and the
    # split's TTFT is the one the run recorded
    assert (parts["after"] >= 0).all()
    run = load_run(tmp_path / "run")
    recorded = np.asarray(run.requests.column("ttft_s"), dtype=float) * 1e3
    np.testing.assert_allclose(np.sort(parts["ttft"]), np.sort(recorded), rtol=1e-9)
    assert np.isfinite(parts["pass_tail"]).all()
    assert set(np.unique(parts["next_eager"])) <= {0.0, 1.0}
    text = line("run", parts)
    assert text.startswith("run: queue ")
    # the means line adds up: its parts' sum is its TTFT, to the printed rounding
    means = text.split("means: ")[1]
    nums = [float(w) for w in means.replace("=", "+").replace(" ms", "").split() if w[0].isdigit()]
    assert len(nums) == 5 and abs(sum(nums[:4]) - nums[4]) <= 0.021
