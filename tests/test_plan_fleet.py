"""Routers and the multi-replica fleet simulation (bubblesim.plan.router, bubblesim.plan.fleet)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import Config
from bubblesim.core.request import Request, Status
from bubblesim.core.trace import Trace, make_trace, read_trace, write_trace
from bubblesim.plan.fleet import FleetSpec, simulate_fleet
from bubblesim.plan.merge import CAUSES_MIN_FRACTION
from bubblesim.plan.router import LeastOutstanding, PrefixAware, RoundRobin, make_router
from bubblesim.plan.spec import parse_slos
from bubblesim.plan.watch import needed_violations
from sim.run import simulate

CFG = Config()  # llama3-8b on an H100: realistic step times, ~30k KV blocks


def _req(i: int, prompt: int, output: int, prefix: int | None = None) -> Request:
    return Request(i, i, 0.0, prompt, output, prefix_id=prefix, prefix_len=64 if prefix else 0)


def _poisson(n: int, rate: float, seed: int = 0, **cols: object) -> Trace:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    return make_trace(arrival, rng.integers(100, 1500, n), rng.integers(16, 160, n), **cols)


def _roundtrip(tr: Trace, tmp_path: Path, name: str = "t.parquet") -> tuple[Path, Trace]:
    p = write_trace(tr, tmp_path / name)
    return p, read_trace(p)


# ---- routers on their own ----------------------------------------------------------------------
def test_round_robin_spreads_evenly() -> None:
    r = RoundRobin(4)
    picks = [r.route(_req(i, 100, 10)) for i in range(42)]
    assert picks[:5] == [0, 1, 2, 3, 0]
    assert r.loads.routed == [11, 11, 10, 10]


def test_least_outstanding_balances_a_skewed_load() -> None:
    # every other request is 50x bigger: round robin piles the big ones on one replica
    sizes = [(4000, 500) if i % 2 == 0 else (60, 20) for i in range(40)]
    tokens = {}
    for router in (RoundRobin(2), LeastOutstanding(2)):
        for i, (p, o) in enumerate(sizes):
            router.route(_req(i, p, o))
        tokens[router.name] = router.loads.outstanding()
    rr, lo = tokens["round-robin"], tokens["least-outstanding"]
    assert max(rr) / min(rr) > 20
    assert max(lo) / min(lo) < 1.1


def test_least_outstanding_counts_only_unfinished_remaining_tokens() -> None:
    r = LeastOutstanding(2)
    a, b = _req(0, 1000, 100), _req(1, 10, 10)
    assert r.route(a) == 0 and r.route(b) == 1
    assert r.loads.outstanding() == [1100, 20]
    a.num_output_tokens = 90
    assert r.loads.outstanding() == [1010, 20]
    a.status = Status.FINISHED
    assert r.loads.outstanding() == [0, 20]
    assert r.route(_req(2, 5, 5)) == 0


def test_prefix_aware_keeps_a_prefix_home_within_the_bound() -> None:
    r = PrefixAware(3, abs_tokens=10**9, rel=1.5)
    picks = [r.route(_req(i, 500, 50, prefix=i % 4)) for i in range(40)]
    homes = {p: {picks[i] for i in range(40) if i % 4 == p} for p in range(4)}
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set.union(*homes.values())) == 3  # new prefixes went to the least loaded
    assert r.sticky == 36 and r.moved == 0


def test_prefix_aware_moves_a_prefix_off_an_overloaded_home() -> None:
    r = PrefixAware(2, abs_tokens=1000, rel=1.5)
    picks = [r.route(_req(i, 500, 50, prefix=7)) for i in range(6)]
    assert picks[:2] == [0, 0] and 1 in picks  # the home filled up, then the prefix moved
    assert r.moved >= 1
    assert make_router("prefix-aware", 2).name == "prefix-aware"
    with pytest.raises(ValueError):
        make_router("random", 2)


# ---- the fleet simulation ----------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2])
def test_one_replica_fleet_is_simulate(tmp_path: Path, depth: int) -> None:
    path, tr = _roundtrip(_poisson(50, 10.0), tmp_path)
    cfg = Config(batches_in_flight=depth, gc_freeze=depth == 2)  # 1: bubbles to attribute
    want = simulate(cfg, path, tmp_path / "run").summary
    got = simulate_fleet(FleetSpec(cfg, 1, "round-robin"), tr)
    for key in (
        "ttft_s",
        "tpot_s",
        "itl_s",
        "e2e_s",
        "output_tok_per_s",
        "req_per_s",
        "span_s",
        "bubble_fraction",
        "num_finished",
        "output_tokens",
    ):
        assert got[key] == want[key], key
    assert got["busy_s"] == pytest.approx(want["gpu_busy_s"])
    if want["bubble_fraction"] > CAUSES_MIN_FRACTION:
        assert got["bubble_s_by_cause"] == {"unattributed": 0.0, **want["bubble_s_by_cause"]}
    else:
        assert got["bubble_s_by_cause"] is None
    assert depth == 2 or want["bubble_fraction"] > 0.01
    assert got["complete"] and got["stopped"] is None


def test_fleet_accounting_adds_up(tmp_path: Path) -> None:
    _, tr = _roundtrip(_poisson(60, 30.0), tmp_path)
    res = simulate_fleet(FleetSpec(CFG, 3, "least-outstanding"), tr)
    reps = res["replicas"]
    assert sum(r["requests"] for r in reps) == 60 == res["num_finished"]
    assert sum(r["output_tokens"] for r in reps) == int(tr.output_len.sum())
    assert res["router"]["routed"] == [r["requests"] for r in reps]
    total = res["busy_s"] + res["bubble_s"] + res["idle_s"]
    assert total == pytest.approx(res["gpu_s"]) and res["gpu_s"] == pytest.approx(3 * res["span_s"])
    for r in reps:
        assert r["busy_s"] + r["bubble_s"] + r["idle_s"] == pytest.approx(res["span_s"])


@pytest.mark.parametrize("spec_method", ["none", "ngram-gpu"])
def test_bubble_totals_match_the_full_accounting(tmp_path: Path, spec_method: str) -> None:
    _, tr = _roundtrip(_poisson(60, 30.0, seed=2), tmp_path)
    cfg = Config(batches_in_flight=1, gc_freeze=False).replace(**{"spec.method": spec_method})
    spec = FleetSpec(cfg, 2, "round-robin", load_factor=2.0)
    full = simulate_fleet(spec, tr, causes=True)
    fast = simulate_fleet(spec, tr)  # off the trace's own load: totals only
    assert fast["bubble_s_by_cause"] is None and full["bubble_s"] > 0
    assert sum(full["bubble_s_by_cause"].values()) == pytest.approx(full["bubble_s"])
    assert full["bubble_s_by_cause"]["unattributed"] == 0
    for key in ("busy_s", "bubble_s", "idle_s", "span_s", "bubble_fraction"):
        assert fast[key] == pytest.approx(full[key], rel=1e-12, abs=1e-12), key
    for a, b in zip(fast["replicas"], full["replicas"]):
        assert a["bubble_s"] == pytest.approx(b["bubble_s"], rel=1e-12, abs=1e-12)


def test_negligible_bubbles_are_not_attributed(tmp_path: Path) -> None:
    _, tr = _roundtrip(_poisson(60, 8.0, seed=2), tmp_path)
    res = simulate_fleet(FleetSpec(CFG, 2, "round-robin"), tr)  # async depth 2: ~no bubbles
    fracs = [r["bubble_fraction"] for r in res["replicas"]]
    assert all(f < CAUSES_MIN_FRACTION for f in fracs), fracs
    assert res["bubble_s_by_cause"] is None


def test_round_robin_fleet_spreads_evenly(tmp_path: Path) -> None:
    _, tr = _roundtrip(_poisson(40, 20.0), tmp_path)
    res = simulate_fleet(FleetSpec(CFG, 4, "round-robin"), tr)
    assert [r["requests"] for r in res["replicas"]] == [10, 10, 10, 10]


@pytest.mark.parametrize("replicas", [2, 3])
def test_round_robin_replicas_run_alone_give_the_shared_run(tmp_path: Path, replicas: int) -> None:
    _, tr = _roundtrip(_poisson(90, 40.0, seed=4), tmp_path)
    cfg = Config(batches_in_flight=1, gc_freeze=False)
    spec = FleetSpec(cfg, replicas, "round-robin")
    alone = simulate_fleet(spec, tr)
    shared = simulate_fleet(spec, tr, shared_env=True)
    alone.pop("sim")
    shared.pop("sim")
    assert alone == shared


def test_round_robin_run_alone_stops_early_with_the_right_verdict(tmp_path: Path) -> None:
    _, tr = _roundtrip(_poisson(150, 25.0, seed=5), tmp_path)
    slos = parse_slos(["ttft_p99_s=0.3", "tpot_p99_s=0.04"])
    for factor in (2.0, 6.0, 40.0):
        spec = FleetSpec(CFG, 2, "round-robin", load_factor=factor)
        full = simulate_fleet(spec, tr, slos, early_stop=False)
        fast = simulate_fleet(spec, tr, slos)
        assert fast["complete"] == all(s.met(full) for s in slos), factor
        if not fast["complete"]:
            assert not next(s for s in slos if s.key == fast["stopped"]["slo"]).met(full)


def test_least_outstanding_beats_round_robin_on_skewed_sizes(tmp_path: Path) -> None:
    n = 48
    big = np.arange(n) % 2 == 0
    tr = make_trace(np.arange(n) * 0.02, np.where(big, 6000, 64), np.where(big, 300, 16))
    _, tr = _roundtrip(tr, tmp_path)
    rr = simulate_fleet(FleetSpec(CFG, 2, "round-robin"), tr)
    lo = simulate_fleet(FleetSpec(CFG, 2, "least-outstanding"), tr)
    assert rr["replicas"][0]["output_tokens"] > 10 * rr["replicas"][1]["output_tokens"]
    assert lo["e2e_s"]["p99"] < rr["e2e_s"]["p99"]


def test_prefix_aware_fleet_keeps_prefixes_together(tmp_path: Path) -> None:
    n = 60
    group = (np.arange(n) % 5).astype(np.int32)
    tr = _poisson(
        n,
        10.0,
        prefix_group=group,
        prefix_keys=np.arange(5, dtype=np.int64),
        prefix_len=np.full(n, 64, np.int32),
    )
    _, tr = _roundtrip(tr, tmp_path)
    res = simulate_fleet(FleetSpec(CFG, 3, "prefix-aware", prefix_abs_tokens=10**9), tr)
    assert res["router"]["sticky"] == n - 5 and res["router"]["moved"] == 0
    assert sorted(res["router"]["routed"]) == [12, 24, 24]  # 5 prefixes of 12 over 3 replicas


def test_more_replicas_never_violate_more(tmp_path: Path) -> None:
    _, tr = _roundtrip(_poisson(120, 40.0, seed=3), tmp_path)
    slos = parse_slos(["ttft_p50_s=0.05", "ttft_p99_s=0.1", "tpot_p99_s=0.012", "e2e_p99_s=1.2"])
    p99, over = [], []
    for router in ("round-robin", "least-outstanding"):
        for n in (1, 2, 3, 4):
            res = simulate_fleet(FleetSpec(CFG, n, router), tr, slos, early_stop=False)
            p99.append(res["ttft_s"]["p99"])
            over.append(sum(not s.met(res) for s in slos))
        assert over[0] > 0 and over[-1] == 0, (router, p99, over)
        assert all(a >= b for a, b in zip(over, over[1:])), (router, over)
        assert min(p99[1:]) < p99[0] / 1.5  # (p99 need not fall strictly: routing noise)
        p99, over = [], []


@pytest.mark.parametrize("factor", [1.0, 3.0, 6.0, 12.0])
def test_early_stop_gives_the_same_verdict(tmp_path: Path, factor: float) -> None:
    _, tr = _roundtrip(_poisson(150, 25.0, seed=5), tmp_path)
    slos = parse_slos(["ttft_p99_s=0.3", "e2e_p99_s=3", "tpot_p99_s=0.04"])
    spec = FleetSpec(CFG, 1, "round-robin", load_factor=factor)
    full = simulate_fleet(spec, tr, slos, early_stop=False)
    fast = simulate_fleet(spec, tr, slos, early_stop=True)
    ok_full = all(s.met(full) for s in slos)
    assert fast["complete"] == ok_full or fast["complete"]
    if fast["complete"]:
        assert {k: fast[k] for k in ("ttft_s", "e2e_s", "tpot_s")} == {
            k: full[k] for k in ("ttft_s", "e2e_s", "tpot_s")
        }
    else:
        assert not ok_full
        key = fast["stopped"]["slo"]
        assert not next(s for s in slos if s.key == key).met(full)
        assert fast["sim"]["steps"] < full["sim"]["steps"]


def test_early_stop_also_behind_a_router(tmp_path: Path) -> None:
    _, tr = _roundtrip(_poisson(150, 25.0, seed=5), tmp_path)
    slos = parse_slos(["ttft_p99_s=0.3"])
    spec = FleetSpec(CFG, 2, "least-outstanding", load_factor=20.0)
    full = simulate_fleet(spec, tr, slos, early_stop=False)
    fast = simulate_fleet(spec, tr, slos)
    assert not slos[0].met(full)
    assert fast["stopped"]["slo"] == "ttft_p99_s" and fast["num_routed"] < 150


def test_needed_violations_is_the_linear_quantile_bound() -> None:
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 100, 101, 1000):
        for q in (0.5, 0.9, 0.99):
            k = needed_violations(n, q)
            v = np.sort(rng.random(n))
            limit = v[n - k] - 1e-12  # exactly k values above the limit
            assert np.quantile(v, q) > limit
            if k > 1:  # with k - 1 just above the limit, the quantile can be within it
                w = np.concatenate([np.zeros(n - k + 1), np.full(k - 1, 1.0 + 1e-9)])
                assert np.quantile(w, q) <= 1.0
