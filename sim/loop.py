"""The engine step loop as a SimPy process: one CPU thread and one in-order GPU stream.

The CPU thread mirrors `engine.Engine.step` phase for phase:

    schedule -> prepare_inputs -> launch -> sample -> draft        (while < depth in flight)
    [sync on the oldest batch] -> process_outputs                   (when depth are in flight)

At the loop's top it takes the requests that arrived in, as `engine.Engine.run` does, which
costs the host the profile's `intake` time in no phase (SimLoop.intake); an idle loop sleeps
until the next arrival and wakes `intake.wake_ms` after it (SimLoop._idle).
The GPU stream runs passes in launch order: pass j starts at max(launch_end_j, gpu_end_{j-1})
and its end is known the moment it is launched, so the stream needs no process of its own: a
`Pass` carries its GPU times and a sync point is an explicit edge, `cpu = max(cpu, event_s)`
(recorded as a sync wait when the CPU gets there first).
The CPU thread keeps its own clock `self.cpu_s`. With its own arrivals (`run()`), nothing else
shares the model, so it reads arrivals straight from the sorted request list and never yields
inside a step; behind a router (`start(own_arrivals=False)` + `submit`) it yields to SimPy at
each step's top so that requests submitted up to its clock are visible to `schedule()`.
A step's timing (its CPU phases with their spread and GC pauses, its waits, its GPU pass) is
sim.clock.StepClock, the one phase block the fast path (sim.fast) runs too: runs of decode steps
in bulk (with speculative decoding: runs of verify steps, single steps scheduled in fewer
operations), so the result is the same bit for bit (tests/test_sim_fastforward.py).
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import simpy

from bubblesim.core import phases as P
from bubblesim.core.config import Config
from bubblesim.core.policy import Scheduler
from bubblesim.core.request import Request, Status
from bubblesim.core.runfmt import RunRecorder
from bubblesim.core.shape import BatchShape
from sim.acceptance import AcceptanceModel
from sim.clock import NO_EVENT, PO1, PO_OBJS, PO_S, Pass, StepClock, launched_pass
from sim.cost import CostModel
from sim.cost.spread import PhaseSpread, phase_spread
from sim.fast import FastForward, SpecForward, SpecSteps
from sim.gcmodel import GCModel
from sim.stepcosts import StepCosts

Event = simpy.events.Event
_EMPTY = BatchShape()
_INF = float("inf")
FINISHED = Status.FINISHED
__all__ = ["Pass", "SimLoop"]


class SimLoop:
    def __init__(
        self,
        cfg: Config,
        sched: Scheduler,
        cost: CostModel,
        rec: RunRecorder,
        requests: list[Request],
        accept: AcceptanceModel,
        gc: GCModel,
        progress: Callable[[int], None] | None = None,
        env: simpy.Environment | None = None,
        *,
        fast_forward: bool = True,
        check_invariants: bool = False,
        stream: int = 0,
    ) -> None:
        """`fast_forward`: compute runs of identical decode steps in bulk (same result);
        `check_invariants`: check the policy's invariants after every step (tests, debugging);
        `stream`: this replica's stream of CPU phase multipliers (sim.cost.spread)."""
        self.cfg = cfg
        self.sched = sched
        self.cost = cost
        self.rec = rec
        self.requests = requests  # this replica's requests, sorted by arrival
        self.num_requests = len(requests)
        self.accept = accept
        self.gc = gc
        self.progress = progress
        # when `progress` next wants to look (an SLO check): a fast-forward segment ends with
        # the first step it completes at or after this CPU time, so the hook then sees what it
        # would see called after every step
        self.tick_at_s = _INF
        self.env = env or simpy.Environment()  # shared by replicas behind a router
        # the CPU thread's clock (>= env.now while it runs ahead) and the GPU stream
        self.clock = StepClock(
            gc, phase_spread(cost.profile, cfg.seed, stream), cost.sync_wake_s,
            cost.idle_start, cfg.spec.method == "ngram-cpu", cost.eager_lag_s,
            cfg.tensor_parallel_size - 1,
        )  # fmt: skip
        # the profile's measured CPU spread: one multiplier per (step, phase), None without
        self.spread: PhaseSpread | None = self.clock.spread
        self.costs = StepCosts(cost, cfg.cuda_graphs)
        self.num_arrived = 0
        self.taken = 0  # requests submitted since the last intake (SimLoop.intake)
        self.intake_on = cost.intake_s > 0 or cost.intake_per_request_s > 0
        # most requests running at once (running grows only by admission): a run where it
        # stays below max_num_seqs never met that limit, and is the run of any limit above it
        self.peak_running = 0
        self.next_arrival = 0  # own arrivals: index of the next request to submit
        self.own_arrivals = False
        self.check = check_invariants
        self._wake: Event | None = None
        self.inflight: deque[Pass] = deque()
        self.depth = cfg.depth  # 1 with ngram-cpu (synchronous, as vLLM), else batches_in_flight
        self.spec = cfg.spec.enabled
        # spec decoding before PR 32951: prepare_inputs waits for the last step's counts
        self.wait_for_counts = self.spec and not cfg.optimistic_spec_decode
        self.cpu_ngram = self.clock.cpu_ngram
        # Runs of decode steps in bulk (sim.fast), with own arrivals only: behind a router the
        # next submit is unknown. Drafts vary per step, so with spec decoding runs of verify
        # steps are SpecForward's, and single steps are scheduled by SpecSteps in fewer
        # operations whoever feeds the replica.
        self.ff: FastForward | SpecForward | None = None
        self.spec_steps: SpecSteps | None = None
        if fast_forward and not self.spec:
            self.ff = FastForward(self)
        elif fast_forward:
            self.ff = SpecForward(self)
            self.spec_steps = SpecSteps(self)

    @property
    def cpu_s(self) -> float:
        """The CPU thread's clock."""
        return self.clock.cpu_s

    @property
    def gpu_free_s(self) -> float:
        """The end of the last pass launched on the GPU stream."""
        return self.clock.gpu_free_s

    # ---- processes --------------------------------------------------------------------------
    def run(self) -> None:
        """Simulate every request (own arrivals). Python's cyclic collector is paused meanwhile
        (and resumed if it was on): the loop frees what it drops by reference counting (it
        leaves no cycles), and collection passes over the objects the run keeps alive cost
        ~8 % of the loop."""
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self.env.run(until=self.start(own_arrivals=True))
        finally:
            if was_enabled:
                gc.enable()

    def start(self, own_arrivals: bool) -> simpy.Process:
        """Start the CPU thread; with `own_arrivals` False a router calls `submit`."""
        self.own_arrivals = own_arrivals
        return self.env.process(self.cpu_thread())

    def submit(self, req: Request) -> None:
        """A request reaches this engine now (its row in `requests` is `req.index`)."""
        self.sched.add(req)
        self.num_arrived += 1
        self.taken += 1
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def cpu_thread(self) -> Generator[Event, Any, None]:
        """The engine loop: one step per iteration."""
        total = len(self.requests)
        sched = self.sched
        while self.num_arrived < total or sched.has_unfinished or self.inflight:
            if self.own_arrivals:
                self.take_arrivals()  # arrivals up to the CPU clock are visible
            else:
                if self.cpu_s > self.env.now:
                    yield self.env.timeout(self.cpu_s - self.env.now)
                if self.taken:
                    self.intake()  # the router's submits since the last top
            if self.ff is not None and self.own_arrivals and self.ff.run_segment():
                continue
            launched = False
            if len(self.inflight) < self.depth and sched.has_unfinished:
                launched = self.launch_step()
            if self.inflight and (not launched or len(self.inflight) >= self.depth):
                self.complete_step(self.inflight.popleft())
            elif not launched and not self.inflight:
                yield from self._idle()
        if self.cpu_s > self.env.now:
            yield self.env.timeout(self.cpu_s - self.env.now)

    # ---- one step ---------------------------------------------------------------------------
    def launch_step(self) -> bool:
        batch = None if self.spec_steps is None else self.spec_steps.schedule()
        if batch is None:
            batch = self.sched.schedule()
        if len(self.sched.running) > self.peak_running:
            self.peak_running = len(self.sched.running)
        clock, rec = self.clock, self.rec
        if batch is None:
            clock.step(rec.num_steps, self.costs.empty(_EMPTY))  # the scan still costs
            clock.flush(rec)
            return False
        shape = batch.shape
        c = self.costs.all(shape)
        counts_s = NO_EVENT
        if self.wait_for_counts and self.inflight:
            counts_s = self.inflight[-1].counts_s
        step = rec.add_step(shape)
        t = clock.step(step, c, counts_s)
        sched0, sched1, prep0, prep1, launch1, _, _, _, sample1, draft0, draft1, _, _ = t
        rec.phase(step, P.SCHEDULE, sched0, sched1)
        rec.phase(step, P.PREPARE_INPUTS, prep0, prep1)
        rec.phase(step, P.LAUNCH, prep1, launch1)
        rec.phase(step, P.SAMPLE, launch1, sample1)
        rec.phase(step, P.DRAFT, draft0, draft1)
        clock.flush(rec)
        for r in batch.preempted:
            rec.preempt(r.index)
        self.inflight.append(launched_pass(batch, step, t, (c[PO_S], c[PO_OBJS])))
        if self.check:
            self.sched.check_invariants()
        return True

    def complete_step(self, p: Pass) -> None:
        t = self.process_outputs(p)
        batch = p.batch
        assert not batch.completed, "batch completed twice"
        batch.completed = True
        sched, rec, accept = self.sched, self.rec, self.accept
        tokens = rec.tokens
        accepted = 0
        finished = []
        # per entry, in entry order: its accepted drafts, then Scheduler.complete's update
        # (a request appears once per batch, so drawing first reads its confirmed outputs)
        for e in batch.entries:
            r = e.req
            a = accept.accepted(r, e.num_drafts) if e.num_drafts and e.generates else 0
            was_finished = r.status == FINISHED
            kept = sched.complete_entry(e, 1 + a)
            accepted += a
            if kept:
                tokens(r.index, t, kept, a if a < kept else kept)
            if r.status == FINISHED:
                if not was_finished:
                    finished.append(r)
                sched.release_finished(r)
        if accepted:
            rec.accepted(p.step, accepted)
        for r in finished:
            rec.finish(r.index, t)
        if self.cpu_ngram:
            self.draft_hints(batch.entries)
        if self.check:
            sched.check_invariants()
        if self.progress is not None:
            self.progress(p.step)

    def process_outputs(self, p: Pass) -> float:
        """The CPU waits for pass `p` and runs its process_outputs phase (recorded, with the
        pass's GPU interval); returns the phase's end, when its tokens are out."""
        rec = self.rec
        t = self.clock.step(
            rec.num_steps - 1, None, NO_EVENT, p.step, p.gpu_end_s, p.po_s, p.po_objs
        )
        po0, po1 = t[PO1 - 1], t[PO1]
        self.clock.flush(rec)
        rec.phase(p.step, P.PROCESS_OUTPUTS, po0, po1)
        rec.gpu(p.step, p.gpu_start_s, p.gpu_end_s)
        return po1

    def draft_hints(self, entries: list[Any]) -> None:
        """The synchronous CPU proposer schedules only the drafts it found (the engine sets the
        same hint), so verify passes carry as many draft tokens as in the real run."""
        accept = self.accept
        for e in entries:
            r = e.req
            if e.generates and not r.is_finished and accept.has_ids(r):
                r.draft_hint = len(accept.drafts_at(r, r.prompt_len + r.num_output_tokens))

    # ---- waiting ----------------------------------------------------------------------------
    def take_arrivals(self) -> float:
        """Submit the requests that arrived up to the CPU clock; returns when the next one
        arrives (inf when none is left), as `next_arrival_s`."""
        reqs, i, n, now = self.requests, self.next_arrival, self.num_requests, self.clock.cpu_s
        next_s = _INF
        while i < n:
            r = reqs[i]  # each row is indexed once here (RequestRows makes it when indexed)
            if r.arrival_s > now:
                next_s = r.arrival_s
                break
            self.submit(r)
            i += 1
        self.next_arrival = i
        if self.taken:
            self.intake()
        return next_s

    def intake(self) -> None:
        """The host takes the requests submitted since the last intake in (engine.Engine.run's
        add_request): the CPU clock moves on by the profile's intake cost, in no phase, as the
        engine's record shows it (a gap before the next schedule). A request that arrives
        meanwhile waits for the next loop top, as in the engine."""
        n, self.taken = self.taken, 0
        if self.intake_on:
            cost = self.cost
            self.clock.cpu_s += cost.intake_s + n * cost.intake_per_request_s

    def next_arrival_s(self) -> float:
        """Own arrivals: when the next request arrives (inf when none is left)."""
        i = self.next_arrival
        return self.requests[i].arrival_s if i < len(self.requests) else _INF

    def _idle(self) -> Generator[Event, Any, None]:
        """Nothing to run: sleep until the next arrival (not a bubble: no request is held)."""
        assert not self.sched.has_unfinished, "requests held but nothing schedulable"
        if self.num_arrived >= len(self.requests):
            return
        if self.own_arrivals:
            self.clock.cpu_s = max(self.cpu_s, self.next_arrival_s() + self.cost.idle_wake_s)
            return
        self._wake = self.env.event()
        yield self._wake
        self._wake = None
        self.clock.cpu_s = max(self.cpu_s, self.env.now + self.cost.idle_wake_s)
