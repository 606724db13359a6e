"""bench/cpu_states.py: a probe's two states read back from units of known speed, the steal
split by state, and the script end to end (a short probe)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from cpu_states import probe_row, steal_split  # noqa: E402


def _units(slow_of_t) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    start = np.arange(0.0, 30.0, 2e-4)
    dur = 1e-4 * np.where(slow_of_t(start), 1.75, 1.0) * np.exp(rng.normal(0, 0.1, start.size))
    return {"start_s": start, "dur_s": dur}


def test_probe_row_reads_the_states() -> None:
    row, m, slow = probe_row("x", _units(lambda t: (t % 2.0) >= 1.2))  # slow 0.8 s of every 2
    assert row["slow_over_fast"] == pytest.approx(1.75, rel=0.03)
    assert row["slow_share"] == pytest.approx(0.4, abs=0.03)
    assert row["slow_stretches"] == 15 and row["slow_stretch_s"] == pytest.approx(0.8, abs=0.1)
    assert row["d_bic"] > 100 and m.size == slow.size == 300
    steady, _, _ = probe_row("y", _units(lambda t: np.zeros(t.size, bool)))
    assert steady["d_bic"] < 10


def test_steal_split_by_state() -> None:
    t = np.arange(0.0, 2.0, 0.05)
    slow = np.zeros(20, bool)
    slow[10:] = True  # the second second is slow
    steal = np.cumsum(np.where(t >= 1.0, 2, 0))
    stat = {"t": t, "steal": steal, "total": np.cumsum(np.full(t.size, 100)),
            "mhz": np.full(t.size, 2100.0)}  # fmt: skip
    got = steal_split(stat, slow)
    assert got is not None and got["steal_fast"] == pytest.approx(0.0, abs=0.001)
    assert got["steal_slow"] == pytest.approx(0.02, rel=0.1) and got["mhz_max"] == 2100.0
    assert steal_split(None, slow) is None


def test_script_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    script = str(ROOT / "bench" / "cpu_states.py")
    cmd = [sys.executable, script, "--seconds", "0.5", "--write", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "unpinned" in res.stdout
    rows = json.loads(out.read_text())
    assert rows[0]["probe"] == "unpinned" and rows[0]["units"] > 100
    bad = subprocess.run([sys.executable, script, "--cpus", "none,none"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "at most once" in bad.stderr
