"""`replay run --timeline-steps / --timeline-from-s` (CPU, tiny model): the measured run's
timeline.json holds the asked window, summary.json records it and the summary says so."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from bubblesim.core.trace import make_trace, write_trace  # noqa: E402


def test_replay_run_timeline_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from replay.__main__ import main

    t = make_trace(np.linspace(0.0, 0.02, 4), [20, 30, 8, 12], [12, 9, 14, 10])
    trace = write_trace(t, tmp_path / "four.parquet")
    out = tmp_path / "run"
    args = ["run", str(trace), "--set", "device=cpu", "--set", "model=tiny", "-o", str(out)]
    assert main([*args, "-q", "--timeline-steps", "5"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    tl = json.loads((out / "timeline.json").read_text())
    total = summary["num_steps"]
    assert total > 5 and summary["timeline"] == tl["otherData"]
    assert tl["otherData"]["first_step"] == 0 and tl["otherData"]["last_step"] == 4
    assert f"timeline: steps 0-4 of {total:,}" in capsys.readouterr().out
    gpu = sorted(e["args"]["step"] for e in tl["traceEvents"] if e.get("cat") == "gpu")
    assert gpu[:5] == [0, 1, 2, 3, 4] and max(gpu) <= 6
