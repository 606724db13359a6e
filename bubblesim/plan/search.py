"""Per candidate: the highest load one replica sustains within the SLOs, and the smallest fleet
that meets them at each asked load. Written as generators that yield the points they need next
(bubblesim.plan.sweep runs them), so a search is a pure function of its own results.

Load search (one replica, arrival rate x factor): factor 1 first; then doubling up (or halving
down) until the verdict flips, then bisection on a geometric scale until hi / lo <= 1 + tol.
The answer is the highest factor seen to pass. It assumes the verdict flips once with load.

Fleet search (load L): n replicas behind the candidate's router. The guess is
ceil(L / max_factor) (one replica carries max_factor), or 1 when one replica passes at no
load factor (arrivals all at once do not scale): n and n - 1 are run together; then
galloping up from the largest failing size or down from the smallest passing one, and
bisection between. It assumes more replicas never fail where fewer pass (tested).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

from bubblesim.plan.points import Point, round_factor
from bubblesim.plan.spec import SLO, Candidate, SearchOptions

Results = list[dict[str, Any]]
Gen = Generator[list[Point], Results, Any]


def verdict(result: dict[str, Any], slos: tuple[SLO, ...]) -> tuple[bool, list[str]]:
    """(meets every SLO, the keys it violates). A run stopped early violates its SLO."""
    bad = [s.key for s in slos if not s.met(result)]
    stopped = result.get("stopped")
    if stopped and stopped["slo"] not in bad:
        bad.append(stopped["slo"])
    return (not bad and bool(result.get("complete", True))), bad


class CandidateSearch:
    def __init__(self, cand: Candidate, opts: SearchOptions, slos: tuple[SLO, ...]) -> None:
        self.cand = cand
        self.opts = opts
        self.slos = slos
        self.config = cand.config.to_dict()
        self.probes: dict[float, dict[str, Any]] = {}  # one replica: factor -> result
        self.fleet_tries: dict[float, dict[int, dict[str, Any]]] = {}

    def point(self, replicas: int, factor: float) -> Point:
        o = self.opts
        return Point(
            self.config,
            replicas,
            round_factor(factor),
            self.cand.router,
            o.prefix_abs_tokens,
            o.prefix_rel,
        )

    def ok(self, result: dict[str, Any]) -> bool:
        return verdict(result, self.slos)[0]

    # ---- the whole search -----------------------------------------------------------------
    def run(self) -> Gen:
        max_factor, capped = yield from self.max_load()
        fleets = yield from parallel([self.min_fleet(load, max_factor) for load in self.opts.loads])
        return {"max_load_factor": max_factor, "max_load_capped": capped, "fleets": fleets}

    # ---- one replica, load search -----------------------------------------------------------
    def probe(self, factor: float) -> Generator[list[Point], Results, bool]:
        factor = round_factor(factor)
        (res,) = yield [self.point(1, factor)]
        self.probes[factor] = res
        return self.ok(res)

    def max_load(self) -> Generator[list[Point], Results, tuple[float, bool]]:
        o = self.opts
        lo: float | None
        hi: float | None
        if (yield from self.probe(1.0)):
            lo, hi, f = 1.0, None, 2.0
            while f <= o.max_load_factor:
                if (yield from self.probe(f)):
                    lo, f = f, f * 2
                else:
                    hi = f
                    break
            if hi is None:
                return lo, True
        else:
            lo, hi, f = None, 1.0, 0.5
            while f >= o.min_load_factor:
                if (yield from self.probe(f)):
                    lo = f
                    break
                hi, f = f, f / 2
            if lo is None:
                return 0.0, False
        while hi / lo > 1 + o.load_tol:
            mid = round_factor(math.sqrt(lo * hi))
            if not lo < mid < hi:
                break
            if (yield from self.probe(mid)):
                lo = mid
            else:
                hi = mid
        return lo, False

    # ---- fleet search -----------------------------------------------------------------------
    def min_fleet(self, load: float, max_factor: float) -> Gen:
        load = round_factor(load)
        tries = self.fleet_tries.setdefault(load, {})
        out: dict[str, Any] = {"load": load, "replicas": None, "tried": tries}
        cap = self.opts.max_replicas
        guess = 1  # no estimate when one replica fails at any load (e.g. a burst at t=0)
        if max_factor > 0:
            guess = min(cap, max(1, math.ceil(load / max_factor - 1e-9)))
        first = [guess, guess - 1] if guess > 1 else [guess]
        results = yield [self.point(n, load) for n in first]
        tries.update(zip(first, results))

        def bounds() -> tuple[int, int | None]:
            """(largest failing size below the smallest passing one, smallest passing one)."""
            passes = [n for n, r in tries.items() if self.ok(r)]
            hi = min(passes, default=None)
            fails = [n for n, r in tries.items() if not self.ok(r) and (hi is None or n < hi)]
            return max(fails, default=0), hi

        lo, top = bounds()
        step = 1
        while top is None:  # gallop up from the largest failing size
            if lo >= cap:
                out["reason"] = f"fails with max_replicas={cap}"
                return out
            n = min(cap, lo + step)
            step *= 2
            tries[n] = (yield [self.point(n, load)])[0]
            lo, top = bounds()
        hi: int = top
        step = 1
        while lo == 0 and hi > 1:  # gallop down from the smallest passing size
            n = max(1, hi - step)
            step *= 2
            tries[n] = (yield [self.point(n, load)])[0]
            lo, top = bounds()
            hi = top if top is not None else hi
        while hi - lo > 1:
            n = (lo + hi) // 2
            tries[n] = (yield [self.point(n, load)])[0]
            lo, top = bounds()
            hi = top if top is not None else hi
        out["replicas"] = hi
        return out


def parallel(gens: list[Gen]) -> Generator[list[Point], Results, list[Any]]:
    """Run several searches in lockstep: each round asks for all their points at once."""
    outcomes: list[Any] = [None] * len(gens)
    asks: dict[int, list[Point]] = {}
    for i, g in enumerate(gens):
        _advance(i, g, None, asks, outcomes)
    while asks:
        order = sorted(asks)
        results = yield [p for i in order for p in asks[i]]
        pos = 0
        for i in order:
            n = len(asks[i])
            part, pos = results[pos : pos + n], pos + n
            _advance(i, gens[i], part, asks, outcomes)
    return outcomes


def _advance(
    i: int, g: Gen, results: Results | None, asks: dict[int, list[Point]], outcomes: list[Any]
) -> None:
    try:
        asks[i] = next(g) if results is None else g.send(results)
    except StopIteration as stop:
        asks.pop(i, None)
        outcomes[i] = stop.value


def search_all(
    cands: tuple[Candidate, ...], opts: SearchOptions, slos: tuple[SLO, ...]
) -> tuple[dict[int, CandidateSearch], dict[int, Gen]]:
    searches = {c.index: CandidateSearch(c, opts, slos) for c in cands}
    return searches, {i: s.run() for i, s in searches.items()}
