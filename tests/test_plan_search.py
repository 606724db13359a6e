"""The per-candidate search (bubblesim.plan.search): load bisection and the smallest fleet."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bubblesim.core.config import Config
from bubblesim.core.trace import make_trace, read_trace, write_trace
from bubblesim.plan.fleet import FleetSpec, simulate_fleet
from bubblesim.plan.points import Point
from bubblesim.plan.search import CandidateSearch, Gen, parallel, verdict
from bubblesim.plan.spec import Candidate, SearchOptions, parse_slos

SLOS = parse_slos(["ttft_p99_s=1"])


def _cand(cfg: Config | None = None, router: str = "round-robin") -> Candidate:
    return Candidate(0, "base", {}, cfg or Config(), router, 2.5)


def _drive(gen: Gen, judge: Callable[[Point], bool]) -> tuple[Any, list[Point]]:
    """Run a search against a fake simulator: a point passes iff judge(point)."""
    asked: list[Point] = []
    try:
        pts = next(gen)
        while True:
            asked += pts
            res = [{"complete": True, "ttft_s": {"p99": 0.5 if judge(p) else 2.0}} for p in pts]
            pts = gen.send(res)
    except StopIteration as stop:
        return stop.value, asked


@pytest.mark.parametrize("knee", [0.05, 0.3, 1.0, 1.7, 5.0, 33.3, 100.0])
def test_load_search_brackets_the_knee(knee: float) -> None:
    opts = SearchOptions(load_tol=0.05, max_load_factor=64)
    s = CandidateSearch(_cand(), opts, SLOS)
    (factor, capped), asked = _drive(s.max_load(), lambda p: p.load_factor <= knee)
    assert asked[0].load_factor == 1.0 and all(p.replicas == 1 for p in asked)
    if knee >= 64:
        assert capped and factor == 64
    elif knee < opts.min_load_factor:
        assert factor == 0
    else:
        assert not capped
        assert factor <= knee < factor * 1.05 * 1.001
    assert len(asked) <= 12


@pytest.mark.parametrize("need", [1, 2, 3, 5, 8, 13, 40])
@pytest.mark.parametrize("max_factor", [0.1, 0.33, 1.0, 3.0])
def test_fleet_search_finds_the_smallest_fleet(need: int, max_factor: float) -> None:
    """Whatever the guess (from max_factor), the answer is the smallest passing size."""
    s = CandidateSearch(_cand(), SearchOptions(max_replicas=64), SLOS)
    out, asked = _drive(s.min_fleet(1.0, max_factor), lambda p: p.replicas >= need)
    assert out["replicas"] == need
    assert all(p.load_factor == 1.0 for p in asked)
    assert len(asked) <= 2 + 2 * math.ceil(math.log2(64)) + 2


def test_fleet_search_gives_up_past_max_replicas() -> None:
    s = CandidateSearch(_cand(), SearchOptions(max_replicas=6), SLOS)
    out, asked = _drive(s.min_fleet(1.0, 0.5), lambda p: p.replicas >= 9)
    assert out["replicas"] is None and "max_replicas=6" in out["reason"]
    assert max(p.replicas for p in asked) == 6
    s = CandidateSearch(_cand(), SearchOptions(max_replicas=6), SLOS)
    out, asked = _drive(s.min_fleet(1.0, 0.0), lambda p: p.replicas >= 5)  # no estimate
    assert out["replicas"] == 5 and asked[0].replicas == 1


def test_parallel_runs_searches_in_lockstep() -> None:
    s = CandidateSearch(_cand(), SearchOptions(), SLOS)
    gens = [s.min_fleet(load, 1.0) for load in (1.0, 4.0, 10.0)]
    outs, asked = _drive(parallel(gens), lambda p: p.replicas >= p.load_factor)
    assert [o["replicas"] for o in outs] == [1, 4, 10]


def test_verdict_of_a_stopped_run() -> None:
    ok, bad = verdict({"complete": False, "stopped": {"slo": "ttft_p99_s"}, "ttft_s": {}}, SLOS)
    assert not ok and bad == ["ttft_p99_s"]
    assert verdict({"complete": True, "ttft_s": {"p99": None}}, SLOS) == (True, [])


def test_search_finds_the_minimal_fleet_on_a_constructed_case(tmp_path: Path) -> None:
    """12 long prompts at once; a replica prefills one per step (token budget = prompt), so
    the k-th request on a replica waits ~k prefills. The TTFT SLO admits 3 per replica: the
    smallest round-robin fleet is 4. Checked against brute force over 1..6 replicas."""
    n, prompt = 12, 8192
    tr = make_trace(np.zeros(n), np.full(n, prompt), np.full(n, 4))
    tr = read_trace(write_trace(tr, tmp_path / "burst.parquet"))
    cfg = Config(max_num_batched_tokens=prompt)
    one = simulate_fleet(FleetSpec(cfg, 12, "round-robin"), tr)["ttft_s"]["p99"]
    slos = parse_slos([f"ttft_p99_s={3.5 * one}"])
    brute = [
        all(s.met(simulate_fleet(FleetSpec(cfg, k, "round-robin"), tr)) for s in slos)
        for k in range(1, 7)
    ]
    assert brute == [False, False, False, True, True, True]
    s = CandidateSearch(_cand(cfg), SearchOptions(), slos)

    def run(points: list[Point]) -> list[dict[str, Any]]:
        return [
            simulate_fleet(FleetSpec(cfg, p.replicas, p.router, p.load_factor), tr, slos)
            for p in points
        ]

    gen = s.run()
    pts = next(gen)
    try:
        while True:
            pts = gen.send(run(pts))
    except StopIteration as stop:
        out = stop.value
    assert out["max_load_factor"] == 0  # arrivals at t=0 do not scale: no factor helps
    assert out["fleets"][0]["replicas"] == 4
    tried = out["fleets"][0]["tried"]
    assert 3 in tried and not verdict(tried[3], slos)[0]
