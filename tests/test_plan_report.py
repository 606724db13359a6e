"""report.html: self-contained, and every plot draws in a real browser (headless Chromium)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import Config
from bubblesim.core.trace import make_trace, write_trace
from bubblesim.plan.planner import run_plan
from bubblesim.plan.report import write_report
from bubblesim.plan.spec import load_plan_spec
from bubblesim.plan.sweep import SerialExecutor

pytestmark = pytest.mark.slow  # the report fixture plans a small sweep (~3 s)

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROME_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(11)
    n = 40
    tr = make_trace(
        np.cumsum(rng.exponential(1 / 10, n)), rng.integers(64, 900, n), rng.integers(8, 64, n)
    )
    d = tmp_path_factory.mktemp("plan")
    trace = write_trace(tr, d / "t.parquet")
    spec = load_plan_spec(
        ["ttft_p99_s=0.12", "tpot_p99_s=0.015"],
        Config(),
        vary=["batches_in_flight=1,2", "gpu=h100,a100"],
        search_over={"loads": [3.0]},
    )
    plan = run_plan(trace, spec, d / "out", SerialExecutor())
    return write_report(plan, d / "out" / "report.html")


def _plots(html: str) -> dict[str, int]:
    return {m[0]: int(m[1]) for m in re.findall(r'data-plot="([^"]+)" data-marks="(\d+)"', html)}


def test_report_is_self_contained_with_every_plot(report: Path) -> None:
    html = report.read_text()
    plots = _plots(html)
    assert set(plots) == {
        "latency-ttft_p99_s",
        "latency-tpot_p99_s",
        "fleet-size",
        "gpu-time",
        "cost",
    }
    for name, marks in plots.items():
        svg = html.split(f'data-plot="{name}"', 1)[1].split("</svg>", 1)[0]
        assert svg.count('class="mark"') == marks > 0, name
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', html)  # nothing fetched
    assert "<script src" not in html and "@import" not in html
    assert 'stroke-dasharray="7 4"' in html or 'class="slo"' in html  # SLO lines drawn


def _browser() -> str | None:
    return next((b for b in BROWSERS if shutil.which(b)), None)


def _chrome(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    browser = _browser()
    assert browser is not None
    profile = tmp_path / "profile"
    cmd = [browser, *CHROME_FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(_browser() is None, reason="no chromium installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    done = _chrome(["--dump-dom", report.as_uri()], tmp_path)
    dom = done.stdout
    assert done.returncode == 0 and "<body" in dom, done.stderr[-2000:]
    want = _plots(report.read_text())
    total = re.search(r'data-plots-total="(\d+)"', dom)
    drawn = re.search(r'data-plots-drawn="(\d+)"', dom)
    assert total and drawn, "the report's check script did not run"
    assert int(total[1]) == len(want) == int(drawn[1])
    got = dict(re.findall(r'data-plot="([^"]+)" data-marks="\d+"[^>]*data-drawn="(\d+)"', dom))
    assert {k: int(v) for k, v in got.items()} == want
    shot = tmp_path / "report.png"
    done = _chrome(["--window-size=1400,2600", f"--screenshot={shot}", report.as_uri()], tmp_path)
    assert done.returncode == 0 and shot.stat().st_size > 20_000
