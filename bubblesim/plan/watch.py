"""Stop a run as soon as its SLO verdict is certain to be "violated".

For n values and quantile q (the linear definition of bubblesim/core/runfmt/stats.py), with
lo = floor((n - 1) q), the quantile is >= the (lo+1)-th smallest value. So once at least
n - lo values are known to exceed the limit, the quantile exceeds it whatever the rest are.
A value is known to exceed the limit when it did (a finished TTFT, E2E or TPOT) or must
(a request still waiting for its first token, or unfinished, for longer than the limit).
The loops call `tick(now, known)` after each step (their `progress` hook); a check runs when
`now` has passed the next multiple of `check_s`. `known()` gives the rows (a count k: rows
0..k-1, or a mask) whose state is known up to `now`: for a lone replica its CPU clock and its
arrived requests; behind a router `env.now` (each CPU thread is at or ahead of it) and the
routed requests; replicas run one after another add the rows of those already run.
Checks only read, so a run that is not stopped is identical to one without a watch. ITL SLOs
are judged at the end only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bubblesim.core.runfmt import RunRecorder
from bubblesim.plan.recview import RequestColumns, request_columns
from bubblesim.plan.spec import SLO

WATCHED = ("ttft", "e2e", "tpot")


class EarlyStop(Exception):
    """The run's verdict is certain: an SLO is violated. One argument, the info dict (SimPy
    re-raises a process's exception as `type(e)(*e.args)`)."""

    def __init__(self, info: dict[str, Any]) -> None:
        super().__init__(info)
        self.info = info


@dataclass(frozen=True)
class _Rule:
    slo: SLO
    needed: int  # violations that make the verdict certain


def needed_violations(n: int, q: float) -> int:
    return n - math.floor((n - 1) * q) if n > 0 else 1


class SLOWatch:
    def __init__(
        self,
        slos: tuple[SLO, ...],
        recorders: list[RunRecorder],
        output_len: np.ndarray,  # per request row
        check_s: float,
    ) -> None:
        n = int(output_len.size)
        n_tpot = int(np.count_nonzero(output_len >= 2))
        self.rules = [
            _Rule(s, needed_violations(n_tpot if s.metric == "tpot" else n, s.q))
            for s in slos
            if s.metric in WATCHED
        ]
        self.cols: list[RequestColumns] = [request_columns(r) for r in recorders]
        self.check_s = check_s
        self.next_s = check_s if self.rules else float("inf")
        self.num_checks = 0

    def restart(self) -> None:
        """A new clock from 0 (the next replica of a fleet run one replica at a time)."""
        self.next_s = self.check_s if self.rules else float("inf")

    def tick(self, now: float, known: Callable[[], int | np.ndarray]) -> None:
        if now >= self.next_s:
            self.next_s = (now // self.check_s + 1) * self.check_s
            self.check(now, known())

    def check(self, now: float, known: int | np.ndarray) -> None:
        """Raise EarlyStop if a watched SLO is surely violated, given the state of the `known`
        rows (k: rows 0..k-1 in arrival order; or a mask) up to `now`."""
        self.num_checks += 1
        sel: slice | np.ndarray = slice(0, known) if isinstance(known, int) else known
        c0 = self.cols[0]
        arrival = c0.arrival[sel]
        if arrival.size == 0:
            return
        first, last, finish, out = (
            c0.first_token[sel],
            c0.last_token[sel],
            c0.finish[sel],
            c0.output_tokens[sel],
        )
        if len(self.cols) > 1:  # a row has values in the recorder of its replica only
            first = np.fmin.reduce([c.first_token[sel] for c in self.cols])
            last = np.fmin.reduce([c.last_token[sel] for c in self.cols])
            finish = np.fmin.reduce([c.finish[sel] for c in self.cols])
            out = np.sum([c.output_tokens[sel] for c in self.cols], axis=0)
        waited = now - arrival
        for rule in self.rules:
            lim = rule.slo.limit_s
            if rule.slo.metric == "ttft":
                bad = np.where(np.isnan(first), waited, first - arrival) > lim
            elif rule.slo.metric == "e2e":
                bad = np.where(np.isnan(finish), waited, finish - arrival) > lim
            else:
                done = ~np.isnan(finish) & (out >= 2)
                tpot = (last[done] - first[done]) / (out[done] - 1)
                bad = tpot > lim
            count = int(np.count_nonzero(bad))
            if count >= rule.needed:
                raise EarlyStop(
                    {
                        "slo": rule.slo.key,
                        "limit_s": lim,
                        "at_s": now,
                        "violations": count,
                        "needed": rule.needed,
                    }
                )
