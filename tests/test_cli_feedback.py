"""What a user sees while and after a command runs: progress (a redrawn bar on a terminal, a
plain line now and then elsewhere, nothing with -q), the overload notice, the timeline window,
and a capacity plan whose load search hit its cap."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

import sim.__main__ as sim_main
from bubblesim.core.cli import run_main
from bubblesim.core.config import Config, load_config
from bubblesim.core.trace import make_trace, write_trace
from sim.overload import overload_line, overload_of
from sim.progress import LoopProgress, Progress
from sim.run import simulate


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Stream(io.StringIO):
    def isatty(self) -> bool:
        return False


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = run_main(sim_main.main, list(argv))
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def trace(tmp: Path, name: str, n: int, span_s: float, prompt: int, output: int) -> Path:
    t = make_trace(np.linspace(0, span_s, n), np.full(n, prompt), np.full(n, output))
    return write_trace(t, tmp / f"{name}.parquet")


# ---- progress ---------------------------------------------------------------------------------
def test_log_mode_prints_a_line_per_tenth_and_none_at_first() -> None:
    clock, out = Clock(), Stream()
    bar = Progress("simulating t", 100.0, " s simulated", stream=out, clock=clock)
    clock.t = 1.0
    bar.update(50.0)  # half done after 1 s: too early for a line (a short run prints nothing)
    assert out.getvalue() == ""
    clock.t = 2.5
    bar.update(55.0)
    clock.t = 2.6
    bar.update(58.0)  # the same tenth, 0.1 s later: nothing new
    lines = out.getvalue().splitlines()
    assert lines == ["simulating t: 55 of 100 s simulated (55 %), 2 s elapsed, ~2 s left"]
    clock.t = 13.0
    bar.update(59.0)  # no new tenth, but 10 s passed: a line anyway
    clock.t = 15.5
    bar.update(71.0)  # a new tenth
    bar.phase("writing run folder")
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and "(59 %)" in lines[1] and "(71 %)" in lines[2]
    assert lines[3] == "simulating t: writing run folder (16 s elapsed)"
    bar.close()
    assert "\r" not in out.getvalue()  # never a redrawn bar in a log


def test_terminal_mode_redraws_one_line_and_erases_it() -> None:
    clock, out = Clock(), Stream()
    bar = Progress("simulating t", 200.0, " s simulated", stream=out, tty=True, clock=clock)
    clock.t = 4.0
    bar.update(50.0)
    clock.t = 4.05
    bar.update(60.0)  # within 0.1 s of the last redraw: skipped
    text = out.getvalue()
    assert text.count("\r") == 1 and "50 of 200 s simulated (25 %)" in text and "~12 s left" in text
    clock.t = 5.0
    bar.phase("writing run folder")
    bar.close()
    assert out.getvalue().endswith("writing run folder (5 s elapsed)\r\033[K")


def test_quiet_prints_nothing() -> None:
    clock, out = Clock(), Stream()
    bar = Progress("x", 10.0, enabled=False, stream=out, tty=True, clock=clock)
    for k in range(1, 11):
        clock.t = 5.0 * k
        bar.update(float(k))
    bar.phase("writing run folder")
    bar.close()
    assert out.getvalue() == ""


def test_sim_progress_counts_simulated_time_then_draining_then_writing(tmp_path: Path) -> None:
    path = trace(tmp_path, "busy", 60, 2.0, 2000, 1000)  # overloaded: a drain after the arrivals
    ticks = iter(np.arange(0.0, 1e6, 3.0))  # every clock read 3 s later: every update logs
    out = Stream()
    bar = Progress("simulating busy", 0.0, stream=out, clock=lambda: float(next(ticks)))
    simulate(Config(), path, tmp_path / "run", progress=bar)
    lines = out.getvalue().splitlines()
    assert bar.total == pytest.approx(2.0) and bar.unit == " s simulated"
    assert any(re.match(r"simulating busy: [\d.]+ of 2 s simulated \(\d+ %\)", ln) for ln in lines)
    assert any("draining: " in ln and "requests left" in ln for ln in lines)
    assert lines[-1].startswith("simulating busy: writing run folder (")


def test_progress_hook_is_not_called_per_step_in_fast_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long decode runs go through the fast path (sim.fast): the hook runs at segment ends only."""
    calls = []
    real = LoopProgress.__call__

    def counting(self: LoopProgress, step: int) -> None:
        calls.append(step)
        real(self, step)

    monkeypatch.setattr(LoopProgress, "__call__", counting)
    path = trace(tmp_path, "decode", 4, 0.0, 64, 3000)
    res = simulate(load_config(None, ["model=tiny"]), path, None, progress=Progress("x", 0.0))
    steps = res.recorder.num_steps
    assert steps >= 3000 and 0 < len(calls) < steps / 20


@pytest.mark.parametrize("spec", [[], ["spec.method=ngram-gpu", "spec.k=3"]], ids=["plain", "spec"])
def test_progress_changes_nothing_in_the_run(tmp_path: Path, spec: list[str]) -> None:
    """Its looks end fast-forward segments early: the run must stay the same, bit for bit."""
    rng = np.random.default_rng(3)
    n = 80
    t = make_trace(
        np.sort(rng.uniform(0, 20, n)), rng.integers(16, 400, n), rng.integers(50, 800, n)
    )
    path = write_trace(t, tmp_path / "mixed.parquet")
    cfg = load_config(None, ["model=tiny", *spec])
    bar = Progress("x", 0.0, stream=Stream())
    with_bar = simulate(cfg, path, tmp_path / "a", progress=bar)
    without = simulate(cfg, path, tmp_path / "b")
    assert with_bar.recorder.num_steps == without.recorder.num_steps > 1000
    for name in ("steps.parquet", "requests.parquet", "gc.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


# ---- overload -----------------------------------------------------------------------------------
def test_overload_definition() -> None:
    arrival = np.linspace(0.0, 19.0, 20)  # 1 req/s offered
    # served one per 3 s from t=0: at the last arrival (19 s) requests 7..18 have no first token
    first = np.arange(20) * 3.0 + 0.5
    finish = first + 2.5
    ov = overload_of(arrival, first, finish)
    assert ov["offered_req_per_s"] == pytest.approx(1.0)
    assert ov["sustained_req_per_s"] == pytest.approx(20 / 60.0)
    assert ov["queued_at_last_arrival"] == 12 and ov["overloaded"] is True
    # the same rates but nothing queued (each request long, none waiting): not overloaded
    ov = overload_of(arrival, arrival + 0.1, arrival + 41.0)
    assert ov["sustained_req_per_s"] < 0.9 * ov["offered_req_per_s"]
    assert ov["queued_at_last_arrival"] == 0 and ov["overloaded"] is False
    # a queue of 4 requests of 20 (over 10 %): still within a normal admission queue
    first = np.where(np.arange(20) >= 15, 30.0, arrival + 0.1)
    ov = overload_of(arrival, first, first + 20.0)
    assert ov["queued_at_last_arrival"] == 4 and ov["overloaded"] is False
    # all at once: no arrival rate to compare with
    burst = overload_of(np.zeros(5), np.full(5, 1.0), np.full(5, 2.0))
    assert burst["offered_req_per_s"] is None and burst["overloaded"] is False


def test_overloaded_run_says_so_and_records_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = trace(tmp_path, "heavy", 200, 2.0, 2000, 200)
    rc, out, _ = cli(capsys, "run", str(path), "-o", str(tmp_path / "heavy"), "-q")
    assert rc == 0
    summary = json.loads((tmp_path / "heavy" / "summary.json").read_text())
    ov = summary["overload"]
    assert ov["overloaded"] is True and ov["offered_req_per_s"] == pytest.approx(199 / 2.0)
    assert ov["sustained_req_per_s"] == pytest.approx(summary["req_per_s"])
    notice = [ln for ln in out.splitlines() if "overloaded:" in ln]
    assert len(notice) == 1 and "99.5 req/s offered" in notice[0]
    assert overload_line(summary) == notice[0].strip()


def test_light_run_has_no_notice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = trace(tmp_path, "light", 20, 2.0, 200, 100)
    rc, out, _ = cli(capsys, "run", str(path), "-o", str(tmp_path / "light"), "-q")
    assert rc == 0 and "overloaded" not in out
    summary = json.loads((tmp_path / "light" / "summary.json").read_text())
    assert summary["overload"]["overloaded"] is False


# ---- the timeline window -------------------------------------------------------------------------
def _timeline(run: Path) -> tuple[dict, dict]:
    tl = json.loads((run / "timeline.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    return tl, summary


def test_timeline_window_is_said_recorded_and_chosen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = trace(tmp_path, "t", 30, 3.0, 300, 50)
    base = ["run", str(path), "-q", "--set", "model=tiny", "--set", "cuda_graphs=false"]
    rc, out, _ = cli(capsys, *base, "-o", str(tmp_path / "a"), "--timeline-steps", "40")
    assert rc == 0
    tl, summary = _timeline(tmp_path / "a")
    total = summary["num_steps"]
    assert total > 100 and summary["timeline"] == tl["otherData"]
    assert tl["otherData"]["first_step"] == 0 and tl["otherData"]["last_step"] == 39
    assert f"timeline: steps 0-39 of {total:,}; --timeline-steps all" in out
    gpu = [e for e in tl["traceEvents"] if e.get("cat") == "gpu"]
    # every track cut at the last time steps 0-39 recorded: a pass launched by then shows too
    steps = [e["args"]["step"] for e in gpu]
    assert steps[:40] == list(range(40)) and max(steps) <= 42

    rc, out, _ = cli(
        capsys, *base, "-o", str(tmp_path / "b"), "--timeline-from-s", "1.5",
        "--timeline-steps", "25",
    )  # fmt: skip
    assert rc == 0
    tl, summary = _timeline(tmp_path / "b")
    w = tl["otherData"]
    assert w["from_s"] == 1.5 and w["steps_exported"] == 25 and w["first_step"] > 0
    assert f"timeline: steps {w['first_step']:,}-{w['first_step'] + 24:,} of" in out
    timed = [e for e in tl["traceEvents"] if e["ph"] in ("X", "C")]
    assert timed and min(e["ts"] for e in timed) >= 1.5e6
    assert max(e["ts"] for e in timed) < w["to_s"] * 1e6
    gpu_steps = [e["args"]["step"] for e in timed if e.get("cat") == "gpu"]
    assert gpu_steps[0] >= w["first_step"] - 2 and w["last_step"] in gpu_steps

    rc, out, _ = cli(capsys, *base, "-o", str(tmp_path / "c"), "--timeline-steps", "all")
    assert rc == 0 and "timeline:" not in out
    tl, summary = _timeline(tmp_path / "c")
    assert tl["otherData"]["steps_exported"] == summary["num_steps"]
    assert tl["otherData"]["truncated"] is False


@pytest.mark.parametrize("bad", [["--timeline-steps", "0"], ["--timeline-from-s", "-1"]])
def test_bad_timeline_option_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str]
) -> None:
    path = trace(tmp_path, "t", 4, 0.1, 32, 8)
    rc, _, err = cli(capsys, "run", str(path), "-o", str(tmp_path / "r"), *bad)
    assert rc == 2 and bad[0] in err
    assert not (tmp_path / "r").exists()


# ---- plan: a load search stopped at its cap ----------------------------------------------------
def test_capped_load_search_says_at_least(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bubblesim.plan.cli import print_plan
    from bubblesim.plan.planner import run_plan
    from bubblesim.plan.report import render
    from bubblesim.plan.spec import load_plan_spec
    from bubblesim.plan.sweep import SerialExecutor

    path = trace(tmp_path, "short", 6, 5.0, 64, 16)  # light and short: passes at any load
    spec = load_plan_spec(
        ["ttft_p99_s=100", "tpot_p99_s=10"],
        load_config(None, ["model=tiny"]),
        search_over={"max_load_factor": 4.0},
    )
    plan = run_plan(path, spec, tmp_path / "plan", SerialExecutor())
    (c,) = plan["candidates"]
    assert c["max_load_factor"] == 4.0 and c["max_load_capped"] is True
    assert plan["best"]["max_load_capped"] is True
    on_disk = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert on_disk["best"]["max_load_capped"] is True
    capsys.readouterr()
    print_plan(plan, tmp_path / "plan")
    out = capsys.readouterr().out
    assert "sustains at least 4x the trace's load" in out
    assert "the load search stopped at its cap (4x" in out
    html = render(plan)
    assert "sustains at least 4x the trace" in html and "stopped at its cap (4x" in html


# ---- whatif and plan progress -------------------------------------------------------------------
def test_whatif_lines_say_percent_and_time_left() -> None:
    from sim.whatif import _progress_line

    assert _progress_line("baseline", 2.0, 1, 4, 3.0) == (
        "[1/4] baseline: 2.0 s (25 %, 3 s elapsed, ~9 s left)"
    )
    assert _progress_line("gc_freeze", 1.0, 4, 4, 12.0).endswith("(100 %, 12 s elapsed)")


def test_plan_progress_logs_now_and_then_off_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bubblesim.plan.cli as plan_cli
    from bubblesim.plan.sweep import SweepStats

    clock = Clock()
    monkeypatch.setattr(plan_cli.time, "monotonic", clock)
    bar = plan_cli._Progress(enabled=True)
    st = SweepStats()
    for t in (1.0, 5.0, 10.5, 12.0, 21.0):
        clock.t = t
        st.run += 1
        bar(st, 2)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "plan: 3 points run, 0 reused, 2 running, 10 s",
        "plan: 5 points run, 0 reused, 2 running, 21 s",
    ]
    quiet = plan_cli._Progress(enabled=False)
    clock.t = 100.0
    quiet(st, 1)
    assert capsys.readouterr().err == ""


def test_a_window_past_the_end_is_empty_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = trace(tmp_path, "t", 4, 0.1, 32, 8)
    run = tmp_path / "r"
    rc, out, _ = cli(capsys, "run", str(path), "-o", str(run), "-q", "--timeline-from-s", "999")
    assert rc == 0 and "timeline: empty, no step starts at or after 999 s" in out
    tl, summary = _timeline(run)
    assert summary["timeline"]["steps_exported"] == 0 and summary["timeline"]["last_step"] is None
    assert not [e for e in tl["traceEvents"] if e["ph"] == "X"]
    # the request counter only says its level at the window's start: nothing left running
    counter = [e for e in tl["traceEvents"] if e["ph"] == "C"]
    assert [(e["ts"], e["args"]["requests"]) for e in counter] == [(999e6, 0)]
