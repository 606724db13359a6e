"""Both reports' charts, drawn by bubblesim.core.svg, are byte-identical to what they were before
the two
chart modules (bubblesim/plan/svg.py, replay/svg.py) became one: the plan report (report.html) from
a
fixed plan.json, the fidelity report's SVG files from the synthetic runs of test_replay.

The expected sha256s are of the outputs of the two old modules at commit 4dc3e1a. A deliberate
change to the charts updates them: `python -m tests.test_report_charts --update`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path

import pytest

from bubblesim.core import svg
from bubblesim.core.runfmt import load_run
from bubblesim.plan.report import render
from replay.analysis import report as replay_report
from replay.analysis.compare import compare_runs
from tests.test_replay import synthetic_run

GOLDEN = Path(__file__).parent / "golden" / "report_charts"
EXPECTED = GOLDEN / "expected.json"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def plan_report_html() -> str:
    plan = json.loads(gzip.decompress((GOLDEN / "plan.json.gz").read_bytes()))
    return render(plan)


def fidelity_svgs(tmp: Path) -> dict[str, str]:
    """The fidelity report's plots as SVG (the path taken without matplotlib)."""
    pred = load_run(synthetic_run(tmp / "p"))
    meas = load_run(synthetic_run(tmp / "m", scale=1.05))
    out = tmp / "fid"
    out.mkdir()
    have = replay_report._have_matplotlib
    replay_report._have_matplotlib = lambda: False
    try:
        replay_report.write_report(compare_runs(pred, meas), pred, meas, out)
    finally:
        replay_report._have_matplotlib = have
    return {p.name: p.read_text() for p in sorted(out.glob("*.svg"))}


def outputs(tmp: Path) -> dict[str, str]:
    return {"report.html": _sha(plan_report_html())} | {
        name: _sha(text) for name, text in fidelity_svgs(tmp).items()
    }


def test_plan_report_is_byte_identical() -> None:
    want = json.loads(EXPECTED.read_text())["report.html"]
    assert _sha(plan_report_html()) == want, "report.html differs from the pre-merge output"


def test_fidelity_svgs_are_byte_identical(tmp_path: Path) -> None:
    want = json.loads(EXPECTED.read_text())
    got = {name: _sha(text) for name, text in fidelity_svgs(tmp_path).items()}
    assert len(got) == 7
    for name, sha in got.items():
        assert sha == want[name], f"{name} differs from the pre-merge output"


@pytest.mark.parametrize(
    ("lo", "hi", "want"),
    [
        (0.0, 1.0, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
        (0.0, 0.3, [0.0, 0.1, 0.2, 0.3]),  # 0.3, not 0.30000000000000004
        (-7.0, 12.0, [-5.0, 0.0, 5.0, 10.0]),
        (3.0, 3.0, [3.0, 3.2, 3.4, 3.6, 3.8, 4.0]),  # an empty range widens to [lo, lo + 1]
        (1e-13, 5e-13, [1e-13, 2e-13, 3e-13, 4e-13, 5e-13]),  # tiny scales keep their ticks
    ],
)
def test_ticks(lo: float, hi: float, want: list[float]) -> None:
    assert svg.ticks(lo, hi) == want


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        EXPECTED.write_text(json.dumps(outputs(Path(d)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {EXPECTED}")
