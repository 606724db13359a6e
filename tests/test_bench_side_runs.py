"""bench/side_runs.py end to end on a short trace: a --jobs 1 row and a pool row, both with the
same seed spread and host band (the script exits 1 if they differ), written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATES = "reports/fidelity/gen/l/profile-h100-llama3.2-1b-states.json"


def test_side_runs_bench(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "bench/side_runs.py", "--trace", "traces/smoke.parquet",
           "--set", "model=llama3.2-1b", "--set", "gpu=h100", "--profile", STATES,
           "--seeds", "2", "--jobs", "2", "--write", str(out)]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())
    assert [r["jobs"] for r in rows] == [1, 2]
    assert all(r["same"] for r in rows) and rows[0]["speedup"] == 1.0
    assert res.stdout.splitlines()[-1].split()[0] == "2"  # the table's last row
