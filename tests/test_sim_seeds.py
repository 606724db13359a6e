"""`sim run --seeds N` (sim.seeds): the run folder is the config's seed, the summary gets the
spread of every flat metric over the N seeds (the folder's own values among them), a config
with nothing seeded spreads by 0, the same command gives the same spread, and a bad N is one
line with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "reports/fidelity/gen/profile-h100-llama3.2-1b.json"  # CPU spread, host speed
BASE = ["run", str(ROOT / "traces/smoke.parquet"), "--set", "model=llama3.2-1b",
        "--set", "gpu=h100", "-q"]  # fmt: skip


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def test_the_folder_is_the_config_s_seed_and_the_spread_holds_it(tmp_path: Path) -> None:
    prof = ["--set", f"profile={PROFILE}"]
    assert main([*BASE, *prof, "--seeds", "3", "-o", str(tmp_path / "s")]) == 0
    assert main([*BASE, *prof, "-o", str(tmp_path / "one")]) == 0
    got, one = _summary(tmp_path / "s"), _summary(tmp_path / "one")
    for key in ("tpot_s", "ttft_s", "e2e_s"):
        assert got[key] == one[key]  # the folder is seed 0's run, to the bit
    sp = got["seed_spread"]
    assert sp["seeds"] == [0, 1, 2]
    for name, value in (("tpot_s.p99", one["tpot_s"]["p99"]), ("ttft_s.p50", one["ttft_s"]["p50"])):
        m = sp["metrics"][name]
        assert m["n"] == 3 and m["min"] <= value <= m["max"] and m["min"] <= m["mean"] <= m["max"]
    assert sp["metrics"]["ttft_s.p50"]["range_rel"] > 0  # the host speed is seeded
    assert "seed_spread" not in one
    again = tmp_path / "again"
    assert main([*BASE, *prof, "--seeds", "3", "-o", str(again)]) == 0
    assert _summary(again)["seed_spread"] == sp  # deterministic


def test_nothing_seeded_spreads_by_zero(tmp_path: Path) -> None:
    assert main([*BASE, "--seeds", "2", "-o", str(tmp_path / "s")]) == 0
    metrics = _summary(tmp_path / "s")["seed_spread"]["metrics"]
    assert metrics["tpot_s.p50"]["range_rel"] == 0.0
    assert metrics["bubble_fraction"]["range_points"] == 0.0


@pytest.mark.parametrize("n", ["0", "101"])
def test_a_bad_count_is_one_line_and_writes_nothing(tmp_path: Path, n: str) -> None:
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "sim", *BASE, "--seeds", n, "-o", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    err = res.stderr.strip()
    assert err == f"error: --seeds {n}: expected 1 to 100"
    assert not out.exists()
