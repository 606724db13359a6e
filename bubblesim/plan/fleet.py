"""A fleet: N replicas of one engine config behind a router, in one SimPy environment.

Each replica is a `SimLoop` with its own Scheduler, KV cache, GC model and RunRecorder; the
router process hands each request, at its arrival, to one replica (`SimLoop.submit`). Requests
are built once (row = arrival rank) and shared: each is only ever in one replica's scheduler.
The acceptance model is shared too (its per-request streams do not depend on the replica), so
a request's drafts are accepted alike whatever the routing.

Behind a state-reading router (least-outstanding, prefix-aware) a replica's `requests` is the
whole trace (its loop cannot know in advance how many it will get), so its CPU thread idles
instead of exiting once the trace is done; `env.run()` returns when no event is left.
A fleet of one replica, and each replica of a round-robin fleet, takes its own arrivals in an
environment of its own: exactly the model of `sim.run.simulate` (and its fast paths).
Load scaling: arrival_s / load_factor, so factor 2 offers twice the trace's request rate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from bubblesim.core.config import Config
from bubblesim.core.gpus import get_gpu
from bubblesim.core.models import get_model, with_context
from bubblesim.core.policy import Scheduler
from bubblesim.core.policy.sizing import kv_blocks_for_gpu, scheduler_config
from bubblesim.core.request import Request
from bubblesim.core.runfmt import RunRecorder
from bubblesim.core.tpfit import fit_error
from bubblesim.core.trace import Trace, TraceError
from bubblesim.plan.merge import fleet_summary
from bubblesim.plan.router import Router, make_router
from bubblesim.plan.spec import SLO
from bubblesim.plan.watch import EarlyStop, SLOWatch
from sim.cost import CostModel, load_cost_model
from sim.gcmodel import GCModel
from sim.loop import SimLoop
from sim.run import acceptance_for, build_requests


@dataclass(frozen=True)
class FleetSpec:
    config: Config
    replicas: int = 1
    router: str = "least-outstanding"
    load_factor: float = 1.0
    prefix_abs_tokens: int = 4096
    prefix_rel: float = 1.5


def kv_blocks(cfg: Config) -> int:
    """KV blocks one replica gets (each of its tensor_parallel_size GPUs holds its KV heads of
    every block); TraceError when the model leaves no room on the GPUs."""
    model = with_context(get_model(cfg.model), cfg.max_model_len)
    gpu = get_gpu(cfg.gpu)
    why = fit_error(cfg, model, gpu)
    if why is not None:
        raise TraceError(why)
    return kv_blocks_for_gpu(cfg, model, gpu.memory_bytes)


def scaled(trace: Trace, load_factor: float) -> Trace:
    if load_factor == 1.0:
        return trace
    return dataclasses.replace(trace, arrival_s=trace.arrival_s / load_factor)


def check_trace_fits(cfg: Config, trace: Trace, name: str) -> None:
    """TraceError naming the first request that one replica of `cfg` can never run."""
    model = with_context(get_model(cfg.model), cfg.max_model_len)
    sched = Scheduler(scheduler_config(cfg, model, kv_blocks(cfg)))
    total = trace.prompt_len.astype(np.int64) + trace.output_len
    row = int(np.argmax(total))  # the longest request is the first to not fit
    req = Request(
        row, trace.request_id[row], 0.0, int(trace.prompt_len[row]), int(trace.output_len[row])
    )
    why = sched.check_fits(req)
    if why is not None:
        raise TraceError(f"{name}: trace request {req.request_id!r} {why}")


class _Fleet:
    def __init__(
        self, spec: FleetSpec, trace: Trace, cost: CostModel, shared_env: bool = False
    ) -> None:
        cfg = spec.config
        model = with_context(get_model(cfg.model), cfg.max_model_len)
        self.num_blocks = kv_blocks(cfg)
        self.env = simpy.Environment()
        self.requests = build_requests(trace, cfg.arrival)
        self.accept = acceptance_for(cfg, trace)
        n, total = spec.replicas, len(self.requests)
        self.owner = np.full(total, -1, dtype=np.int64)
        self.router: Router = make_router(spec.router, n, spec.prefix_abs_tokens, spec.prefix_rel)
        # Round-robin routing reads nothing but arrival order and replicas share nothing, so
        # each replica can run alone on its own requests (own arrivals: the loop's fast paths),
        # one after another, with the same result. Other routers read the replicas' state at
        # each arrival: one environment for all, the router submitting.
        self.split = not shared_env and (n == 1 or spec.router == "round-robin")
        self.rows = [np.arange(r, total, n) for r in range(n)]  # split: replica r's rows
        self.done_rows = np.zeros(total, dtype=bool)  # split: rows of replicas already run
        self.current = 0
        self.watch: SLOWatch | None = None
        self.recorders: list[RunRecorder] = []
        self.loops: list[SimLoop] = []
        self.num_routed = 0
        for r in range(n):
            rec = RunRecorder()
            for req in self.requests:
                rec.add_request(req.request_id, req.arrival_s)
            sched = Scheduler(scheduler_config(cfg, model, self.num_blocks))
            gc = GCModel(cfg.gc, cfg.gc_freeze, cost.gc_pause_ms)
            env, reqs = self.env, self.requests
            if self.split and n > 1:
                env, reqs = simpy.Environment(), [self.requests[i] for i in self.rows[r].tolist()]
            loop = SimLoop(
                cfg, sched, cost, rec, reqs, self.accept, gc, self._tick, env=env, stream=r
            )  # stream: each replica draws its own CPU spread (sim.cost.spread)
            self.recorders.append(rec)
            self.loops.append(loop)

    def _tick(self, step: int) -> None:
        if self.watch is None:
            return
        if self.split:
            loop = self.loops[self.current]
            self.watch.tick(loop.cpu_s, self._known_split)
            loop.tick_at_s = self.watch.next_s  # fast-forwards stop there for the next check
        else:  # every CPU thread is at or ahead of env.now
            self.watch.tick(self.env.now, lambda: self.num_routed)

    def _known_split(self) -> int | np.ndarray:
        """Rows whose state is known up to the running replica's clock: those of replicas
        already run, and the running one's arrived requests."""
        loop = self.loops[self.current]
        if len(self.loops) == 1:
            return loop.num_arrived
        known = self.done_rows.copy()
        known[self.rows[self.current][: loop.num_arrived]] = True
        return known

    def route(self) -> Generator[simpy.events.Event, Any, None]:
        env = self.env
        for req in self.requests:
            if req.arrival_s > env.now:
                yield env.timeout(req.arrival_s - env.now)
            i = self.router.route(req)
            self.owner[req.index] = i
            self.num_routed += 1
            self.loops[i].submit(req)

    def run(self, watch: SLOWatch | None) -> dict[str, Any] | None:
        """Run to the end; returns the early-stop info if the watch stopped it."""
        self.watch = watch
        if self.split:
            return self._run_split()
        self.env.process(self.route())
        for loop in self.loops:
            loop.start(own_arrivals=False)
        try:
            self.env.run()
        except EarlyStop as stop:
            return stop.info
        return None

    def _run_split(self) -> dict[str, Any] | None:
        for r, loop in enumerate(self.loops):
            self.current = r
            if self.watch is not None:
                self.watch.restart()  # each replica's clock starts at 0
                loop.tick_at_s = self.watch.next_s
            loop.start(own_arrivals=True)
            try:
                loop.env.run()
            except EarlyStop as stop:
                return stop.info
            finally:
                arrived = self.rows[r][: loop.num_arrived]
                self.owner[arrived] = r
                self.done_rows[arrived] = True
                self.router.loads.routed[r] = loop.num_arrived
        return None


def check_interval_s(trace: Trace, slos: tuple[SLO, ...]) -> float:
    """~256 checks over the trace, but no more often than a quarter of the tightest limit."""
    span = float(trace.arrival_s.max() - trace.arrival_s.min()) if len(trace) else 0.0
    tightest = min((s.limit_s for s in slos), default=1.0)
    return max(span / 256, tightest / 4, 1e-3)


def simulate_fleet(
    spec: FleetSpec,
    trace: Trace,
    slos: tuple[SLO, ...] = (),
    early_stop: bool = True,
    cost: CostModel | None = None,
    causes: bool | None = None,
    shared_env: bool = False,
) -> dict[str, Any]:
    """Simulate the fleet on the trace (in arrival order, unscaled); returns the fleet summary
    (bubblesim.plan.merge) plus `complete`, `stopped` (early-stop info or None), `router`, `sim`.
    Bubbles are attributed to causes (`causes`, default: at the trace's own load only).
    `shared_env` runs even a round-robin fleet in one environment (tests: same result)."""
    if spec.replicas < 1:
        raise ValueError("a fleet needs at least one replica")
    cfg = spec.config
    cost = cost or load_cost_model(cfg)
    trace = scaled(trace.by_arrival(), spec.load_factor)
    fleet = _Fleet(spec, trace, cost, shared_env)
    watch = None
    if early_stop and slos:
        watch = SLOWatch(slos, fleet.recorders, trace.output_len, check_interval_s(trace, slos))
    t0 = time.perf_counter()
    stopped = fleet.run(watch)
    wall_s = time.perf_counter() - t0
    if causes is None:
        causes = spec.load_factor == 1.0
    out = fleet_summary(fleet.recorders, fleet.owner, causes)
    out["complete"] = stopped is None
    out["stopped"] = stopped
    out["router"] = {"name": fleet.router.name, **fleet.router.stats}
    out["sim"] = {
        "num_kv_blocks": fleet.num_blocks,
        "steps": sum(rec.num_steps for rec in fleet.recorders),
        "preemptions": sum(lp.sched.num_preemptions for lp in fleet.loops),
        "peak_running": max(lp.peak_running for lp in fleet.loops),
        "wall_s": wall_s,
    }
    return out
