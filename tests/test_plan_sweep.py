"""Sweeps: the same plan whoever runs the points (serial, process pool, Ray), points written as
they finish, and a rerun that skips what is done."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bubblesim.core.cli import run_main
from bubblesim.core.config import Config
from bubblesim.core.trace import make_trace, write_trace
from bubblesim.plan.planner import run_plan
from bubblesim.plan.points import Point, PointStore, point_key, serves
from bubblesim.plan.spec import load_plan_spec, parse_slos
from bubblesim.plan.sweep import PoolExecutor, SerialExecutor
from sim.__main__ import main

SLO = ["ttft_p99_s=0.15", "tpot_p99_s=0.02"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(7)
    n = 50
    arrival = np.cumsum(rng.exponential(1 / 12.0, n))
    tr = make_trace(arrival, rng.integers(64, 1200, n), rng.integers(8, 96, n))
    return write_trace(tr, tmp_path_factory.mktemp("trace") / "t.parquet")


def _spec(**search: Any) -> Any:
    vary = ["batches_in_flight=1,2", "gpu=h100,h200"]
    return load_plan_spec(SLO, Config(), vary=vary, search_over={"loads": [2.0], **search})


def _strip(x: Any) -> Any:
    """The plan without timings (wall clock) or run statistics."""
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in ("wall_s", "cpu_s", "stats")}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


@pytest.fixture(scope="module")
def serial_plan(trace: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("serial")
    return out, run_plan(trace, _spec(), out, SerialExecutor())


def test_plan_answers(serial_plan: tuple[Path, dict]) -> None:
    out, plan = serial_plan
    assert json.loads((out / "plan.json").read_text())["best"] == plan["best"]
    assert len(plan["candidates"]) == 4
    best = plan["best"]
    assert best is not None and best["replicas"] >= 1 and best["cost_per_mtok"] > 0
    for c in plan["candidates"]:
        assert c["max_load_factor"] > 0
        assert [f["load"] for f in c["fleets"]] == [1.0, 2.0]
        assert c["fleets"][1]["replicas"] >= c["fleets"][0]["replicas"]
        factors = [p["factor"] for p in c["load_curve"]]
        assert factors == sorted(factors) and 1.0 in factors
        assert all(p["ok"] == (p["factor"] <= c["max_load_factor"]) for p in c["load_curve"])
    cheapest = min(c["cost_per_mtok"] for c in plan["candidates"] if c["meets_slos"])
    assert best["cost_per_mtok"] == cheapest
    lines = (out / "points.jsonl").read_text().splitlines()
    assert len(lines) == plan["stats"]["points_run"] > 0
    assert len({json.loads(line)["key"] for line in lines}) == len(lines)


def test_pool_gives_the_serial_plan(
    trace: Path, tmp_path: Path, serial_plan: tuple[Path, dict]
) -> None:
    plan = run_plan(trace, _spec(), tmp_path, PoolExecutor(2))
    assert _strip(plan) == _strip(serial_plan[1])


def test_rerun_skips_done_points(
    trace: Path, tmp_path: Path, serial_plan: tuple[Path, dict]
) -> None:
    src, want = serial_plan
    lines = (src / "points.jsonl").read_text().splitlines(keepends=True)
    keep = len(lines) // 2
    # a killed run: half the points written, the last line torn
    (tmp_path / "points.jsonl").write_text("".join(lines[:keep]) + lines[keep][:40])
    plan = run_plan(trace, _spec(), tmp_path, SerialExecutor())
    assert plan["stats"]["points_cached"] >= keep
    assert plan["stats"]["points_run"] == len(lines) - keep
    assert _strip(plan) == _strip(want)
    again = run_plan(trace, _spec(), tmp_path, SerialExecutor())
    assert again["stats"]["points_run"] == 0
    assert _strip(again) == _strip(want)
    fresh = run_plan(trace, _spec(), tmp_path, SerialExecutor(), resume=False)
    assert fresh["stats"]["points_run"] == len(lines)


def test_a_stopped_point_serves_only_as_tight_slos() -> None:
    stopped = {"complete": False, "stopped": {"slo": "ttft_p99_s", "limit_s": 0.5}}
    assert serves(stopped, parse_slos(["ttft_p99_s=0.5"]))
    assert serves(stopped, parse_slos(["ttft_p99_s=0.2", "tpot_p99_s=1"]))
    assert not serves(stopped, parse_slos(["ttft_p99_s=0.8"]))
    assert not serves(stopped, parse_slos(["tpot_p99_s=0.1"]))
    assert serves({"complete": True, "stopped": None}, parse_slos(["tpot_p99_s=0.1"]))


def test_point_keys(tmp_path: Path) -> None:
    cfg = Config().to_dict()
    a = Point(cfg, 1, 2.0, "round-robin")
    assert point_key(a, "sha") == point_key(Point(cfg, 1, 2.0, "prefix-aware"), "sha")
    assert point_key(a, "sha") != point_key(Point(cfg, 2, 2.0, "round-robin"), "sha")
    assert point_key(a, "sha") != point_key(a, "other trace")
    b = Point(cfg, 2, 2.0, "prefix-aware", prefix_abs_tokens=1)
    assert point_key(b, "s") != point_key(Point(cfg, 2, 2.0, "prefix-aware"), "s")
    store = PointStore(tmp_path / "p.jsonl")
    store.add("k", a, {"complete": True, "x": float("nan")}, 0.1)
    assert PointStore(tmp_path / "p.jsonl").records["k"]["result"] == {"complete": True, "x": None}


def test_ray_gives_the_serial_plan(
    trace: Path, tmp_path: Path, serial_plan: tuple[Path, dict]
) -> None:
    ray = pytest.importorskip("ray", reason="ray is not installed (optional extra 'plan')")
    from bubblesim.plan.sweep import RayExecutor

    try:
        plan = run_plan(trace, _spec(), tmp_path, RayExecutor("local", str(trace)))
    finally:
        ray.shutdown()
    assert _strip(plan) == _strip(serial_plan[1])


def test_cli_end_to_end(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    argv = [
        "plan",
        str(trace),
        "--slo",
        SLO[0],
        "--slo",
        SLO[1],
        "--vary",
        "batches_in_flight=1,2",
        "--jobs",
        "2",
        "-o",
        str(out),
        "-q",
    ]
    assert run_main(main, argv) == 0
    text = capsys.readouterr().out
    assert "best:" in text and "per million output tokens" in text
    plan = json.loads((out / "plan.json").read_text())
    assert plan["best"]["replicas"] >= 1 and plan["slos"] == {
        "ttft_p99_s": 0.15,
        "tpot_p99_s": 0.02,
    }
    assert (out / "report.html").stat().st_size > 1000
    assert run_main(main, argv) == 0  # a rerun reuses every point
    assert "0 points run" in capsys.readouterr().out


def _one(point: Point) -> Any:
    (result,) = yield [point]
    return result


def _sweep(trace: Path, store: Path, points: list[Point], reuse: bool) -> tuple[list, Any]:
    from bubblesim.core.trace import trace_sha256
    from bubblesim.plan.sweep import Driver

    driver = Driver(SerialExecutor(), PointStore(store, resume=False), str(trace),
                    trace_sha256(trace), parse_slos(SLO), True, reuse=reuse)  # fmt: skip
    out = driver.run({i: _one(p) for i, p in enumerate(points)})
    return [out[i] for i in range(len(points))], driver.stats


def test_points_differing_only_in_an_unmet_max_num_seqs_share_one_run(
    trace: Path, tmp_path: Path
) -> None:
    """A run that never had max_num_seqs requests running is the run of the same point with any
    limit above its peak: the driver answers such points with it, and every answer is what
    running the point gives. A limit the run met is run on its own."""
    seqs = [256, 2, 64, 3, 1024]
    points = [
        Point(Config().replace(batches_in_flight=d, max_num_seqs=s, **{"spec.method": m})
              .to_dict(), 1, load, "round-robin")
        for d, m in ((1, "none"), (2, "ngram-gpu")) for load in (1.0, 3.0) for s in seqs
    ]  # fmt: skip
    same, st = _sweep(trace, tmp_path / "a.jsonl", points, reuse=True)
    alone, st_alone = _sweep(trace, tmp_path / "b.jsonl", points, reuse=False)
    assert st_alone.same == 0 and st.same > 0 and st.run + st.same == len(points)
    for p, x, y in zip(points, same, alone, strict=True):
        assert _strip(x) == _strip(y), p.config["max_num_seqs"]
        peak = y["sim"]["peak_running"]
        assert peak <= p.config["max_num_seqs"]
        if peak == p.config["max_num_seqs"]:  # the limit was met: only its own run answers
            assert x["cpu_s"] > 0
    assert any(y["sim"]["peak_running"] == 2 for y in alone), "no point met its limit"
    lines = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert sum("same_as" in rec for rec in lines) == st.same
