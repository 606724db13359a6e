"""reports/fidelity/change.py: a config change measured beside its prediction, from two checks'
comparison files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "reports/fidelity/change.py"
KEYS = ("output_tok_per_s", "tpot_s.p50", "tpot_s.p99", "ttft_s.p50", "e2e_s.p50")


def _comparison(path: Path, predicted: float, measured: float, bubble: tuple[float, float]) -> Path:
    metrics = {k: {"predicted": predicted, "measured": measured} for k in KEYS}
    metrics["bubble_fraction"] = {"predicted": bubble[0], "measured": bubble[1]}
    path.write_text(json.dumps({"metrics": metrics}))
    return path


def _run(*args: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True
    )


def test_measured_and_predicted_change_per_metric(tmp_path: Path) -> None:
    before = _comparison(tmp_path / "h100-a-d2.json", 2.0, 4.0, (0.10, 0.20))
    after = _comparison(tmp_path / "h100-a-d3.json", 2.2, 3.0, (0.15, 0.17))
    # replay compare's file is named by its folder
    folder = tmp_path / "fid-a-host"
    folder.mkdir()
    after2 = _comparison(folder / "fidelity.json", 1.0, 4.0, (0.10, 0.20))
    r = _run(before, after, before, after2)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| h100-a-d2")]
    # measured 4 -> 3: -25 %; predicted 2 -> 2.2: +10 %; bubbles 20 -> 17 % and 10 -> 15 %
    assert rows[0] == (
        "| h100-a-d2 -> h100-a-d3 | " + " | ".join(["-25.0 / +10.0 %"] * 5)
        + " | -3.00 / +5.00 pt |"
    )  # fmt: skip
    assert rows[1].startswith("| h100-a-d2 -> fid-a-host | +0.0 / -50.0 % |")


def test_refuses_an_odd_count_or_a_missing_file(tmp_path: Path) -> None:
    one = _comparison(tmp_path / "one.json", 1.0, 1.0, (0.0, 0.0))
    r = _run(one)
    assert r.returncode == 2 and "in pairs" in r.stderr
    r = _run(one, tmp_path / "absent.json")
    assert r.returncode == 2 and "absent.json" in r.stderr
