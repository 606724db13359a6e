"""Routers: which replica of a fleet gets each arriving request.

A replica's load is its outstanding tokens: prompt + remaining output of every request routed
to it and not finished (what a router that sees request sizes can count). Ties go to the
lowest replica index, so routing is deterministic.
- round-robin: replica i % n for the i-th request, load blind.
- least-outstanding: the replica with the fewest outstanding tokens.
- prefix-aware: requests of one prefix_id go to that prefix's home replica while the home is
  not overloaded (its load exceeds the least loaded replica's by more than `abs_tokens` AND
  by more than a factor `rel`); otherwise to the least loaded replica, which becomes the home.
  Requests without a prefix go to the least loaded replica.
"""

from __future__ import annotations

from collections.abc import Hashable

from bubblesim.core.request import Request, Status


class Loads:
    """Outstanding tokens per replica, from the requests routed and not yet finished."""

    def __init__(self, num_replicas: int) -> None:
        self.active: list[list[Request]] = [[] for _ in range(num_replicas)]
        self.routed = [0] * num_replicas  # requests routed, ever

    def add(self, replica: int, req: Request) -> None:
        self.active[replica].append(req)
        self.routed[replica] += 1

    def outstanding(self) -> list[int]:
        out = []
        for i, reqs in enumerate(self.active):
            live = [r for r in reqs if r.status != Status.FINISHED]
            self.active[i] = live
            out.append(sum(r.prompt_len + r.output_len - r.num_output_tokens for r in live))
        return out


def _argmin(values: list[int]) -> int:
    return min(range(len(values)), key=values.__getitem__)  # first minimum: lowest index


class Router:
    name = "router"

    def __init__(self, num_replicas: int) -> None:
        self.n = num_replicas
        self.loads = Loads(num_replicas)

    def route(self, req: Request) -> int:
        i = self.pick(req)
        self.loads.add(i, req)
        return i

    def pick(self, req: Request) -> int:
        raise NotImplementedError

    @property
    def stats(self) -> dict[str, object]:
        return {"routed": list(self.loads.routed)}


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def pick(self, req: Request) -> int:
        i = self._next
        self._next = (i + 1) % self.n
        return i


class LeastOutstanding(Router):
    name = "least-outstanding"

    def pick(self, req: Request) -> int:
        return _argmin(self.loads.outstanding()) if self.n > 1 else 0


class PrefixAware(Router):
    name = "prefix-aware"

    def __init__(self, num_replicas: int, abs_tokens: int = 4096, rel: float = 1.5) -> None:
        super().__init__(num_replicas)
        self.abs_tokens = abs_tokens
        self.rel = rel
        self.home: dict[Hashable, int] = {}  # prefix_id -> replica (looked up, not iterated)
        self.sticky = 0  # requests sent to their prefix's home
        self.moved = 0  # requests whose home was overloaded

    def pick(self, req: Request) -> int:
        if self.n == 1:
            return 0
        load = self.loads.outstanding()
        least = _argmin(load)
        if req.prefix_id is None:
            return least
        home = self.home.get(req.prefix_id)
        if home is not None:
            over = (
                load[home] - load[least] > self.abs_tokens and load[home] > self.rel * load[least]
            )
            if not over:
                self.sticky += 1
                return home
            self.moved += 1
        self.home[req.prefix_id] = least
        return least

    @property
    def stats(self) -> dict[str, object]:
        return {**super().stats, "sticky": self.sticky, "moved": self.moved}


def make_router(name: str, num_replicas: int, abs_tokens: int = 4096, rel: float = 1.5) -> Router:
    if name == "round-robin":
        return RoundRobin(num_replicas)
    if name == "least-outstanding":
        return LeastOutstanding(num_replicas)
    if name == "prefix-aware":
        return PrefixAware(num_replicas, abs_tokens, rel)
    raise ValueError(f"unknown router {name!r}")
