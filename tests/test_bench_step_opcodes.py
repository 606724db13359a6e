"""bench/step_opcodes.py on the smoke trace: the counts are exact (two runs give the same), the
step loop's parts add up to its total, and the phase block is among them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(out: Path) -> dict:
    cmd = [sys.executable, "bench/step_opcodes.py", "--trace", "traces/smoke.parquet",
           "--limit-s", "1e9", "--set", "model=llama3.2-1b", "--write", str(out)]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "ops a step, against" in res.stdout.splitlines()[-1]
    return json.loads(out.read_text())


def test_step_opcodes_bench(tmp_path: Path) -> None:
    a, b = _rows(tmp_path / "a.json"), _rows(tmp_path / "b.json")
    exact = ("steps", "bare_ops_per_step", "loop_ops_per_step", "loop_ops_per_step_by_part")
    assert {k: a[k] for k in exact} == {k: b[k] for k in exact}
    parts = a["loop_ops_per_step_by_part"]
    assert abs(sum(parts.values()) - a["loop_ops_per_step"]) < 1e-6
    assert parts["StepClock.step (sim/clock.py)"] > 0 and a["steps"] > 0
    assert a["bare_ops_per_step"] > 100  # two generators, a timeout and a Store a step
