"""reports/fidelity/isolate.py: a run's decode batches and their uniform twins written as a
batches file, and the report's ratios read back from a sweep that timed them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import sim.run as simrun
from bubblesim.core.config import load_config
from replay.analysis.batches_file import read_batches

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "reports" / "fidelity"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from isolate import prep, report, uniform  # noqa: E402
from synthetic_sweep import write_timed  # noqa: E402
from test_sim_max_kv import _mixed_trace  # noqa: E402

PROFILE = ROOT / "reports" / "fidelity" / "gen" / "profile-h100-llama3-8b.json"


def test_uniform_twin() -> None:
    assert uniform([10, 1, 4]) == [5, 5, 5]
    assert uniform([10, 2, 4, 1]) == [5, 4, 4, 4]
    assert sum(uniform([1821, 977, 33])) == 1821 + 977 + 33


def test_prep_then_report(tmp_path: Path) -> None:
    trace = _mixed_trace(tmp_path, 5)
    simrun.simulate(load_config(None, ["model=llama3-8b", "gpu=h100"]), trace, tmp_path / "run")
    out = tmp_path / "batches.json"
    n = prep(PROFILE, [tmp_path / "run"], out, per_run=12, min_rows=8)
    assert 0 < n <= 12 * 5  # at most 12 a band of rows from 8 (gen_diagnose.BANDS)
    batches = read_batches(out)
    doc = json.loads(out.read_text())
    assert len(batches) == 2 * n == 2 * len(doc["steps"])
    for b, twin in zip(batches[::2], batches[1::2], strict=True):
        assert b.label.endswith(":mixed") and twin.label == b.label.replace(":mixed", ":uniform")
        assert len(b.entries) == len(twin.entries) >= 8
        assert sum(e.seq_len for e in b.entries) == sum(e.seq_len for e in twin.entries)
    # a sweep that timed each batch alone: the mixed ones at the step's measured time, the twins
    # 2 % over the profile's pass for them
    timed = []
    for b in batches:
        st = doc["steps"][b.label.rsplit(":", 1)[0]]
        ms = st["measured_ms"] if b.label.endswith(":mixed") else 1.02 * st["predicted_uniform_ms"]
        timed.append((b, ms))
    sweep = write_timed(tmp_path / "alone.parquet", timed)
    lines = report(out, sweep, None)
    assert len(lines) == 6 and lines[3].startswith("refitted")  # one run: no pass lines
    assert "in-run / alone 1.000" in lines[1]
    assert "twin alone / the profile's pass for it 1.020" in lines[1]
    assert lines[2].lstrip().startswith("excess alone (mixed - twin)")


def test_the_pass_with_a_term_scaled_on_the_other_runs() -> None:
    """Two runs whose excess is exactly 2 ms a unit of the term: the refit gives 2, and each run's
    pass (the twin's + the term scaled on the other run) is what it measured."""
    from isolate import _refit

    def step(run: str, x: float, twin_ms: float) -> dict[str, float | str]:
        return {"run": run, "alone": twin_ms + 2 * x, "twin": twin_ms, "excess_keys": x,
                "tail_term_ms": 2 * x, "measured_ms": twin_ms + 2 * x,
                "predicted_uniform_ms": twin_ms, "predicted_ms": twin_ms + 1.5 * x}  # fmt: skip

    by_run = {"a": [step("a", 1, 10), step("a", 2, 11)], "b": [step("b", 1, 9), step("b", 3, 12)]}
    lines = _refit(by_run)  # type: ignore[arg-type]
    assert lines[1].startswith("   the tail term: x 1, R^2 1.000")
    assert lines[2].startswith("   the excess keys: x 2, R^2 1.000; a 1.000, b 1.000")
    assert lines[3].startswith("the pass")
    assert lines[5] == "   the tail term: a 1.000, b 1.000"
    assert lines[6] == "   the excess keys: a 1.000, b 1.000"
    assert lines[4].startswith("   the profile: a 1.") and "b 1." in lines[4]
