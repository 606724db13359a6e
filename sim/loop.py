"""The engine step loop as SimPy processes: arrivals, one CPU thread, one GPU stream.

The CPU process mirrors `engine.Engine.step` phase for phase:

    schedule -> prepare_inputs -> launch -> sample -> draft        (while < depth in flight)
    [sync on the oldest batch] -> process_outputs                   (when depth are in flight)

The GPU process runs passes in launch order; pass j starts at max(launch_end_j, gpu_end_{j-1}).
Sync points are explicit edges: the CPU waits for an event the GPU process sets at a pass's end.
The CPU thread keeps its own clock `self.cpu_s` and only yields to SimPy where it must meet the
rest of the model (reading arrivals at schedule time, waiting for the GPU), so a step costs a few
SimPy events whatever the number of phases.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from core import phases as P
from core.config import Config
from core.policy import ScheduledBatch, Scheduler
from core.request import Request
from core.runfmt import RunRecorder
from core.shape import BatchShape
from sim.acceptance import AcceptanceModel
from sim.cost import CostModel
from sim.gcmodel import GCModel

Event = simpy.events.Event


@dataclass(slots=True)
class Pass:
    """A launched batch: what the GPU stream runs and the CPU later syncs on."""

    batch: ScheduledBatch
    step: int  # recorder row
    ready_s: float  # launch done on the CPU: the earliest the GPU may start it
    gpu_s: float  # GPU duration
    draft_s: float  # GPU drafting after the forward + sampling
    counts: Event  # accepted counts known (after sampling/rejection, before GPU drafting)
    done: Event
    gpu_start_s: float = 0.0
    gpu_end_s: float = 0.0


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
    ) -> None:
        self.cfg = cfg
        self.sched = sched
        self.cost = cost
        self.rec = rec
        self.requests = requests  # this replica's requests, sorted by arrival
        self.accept = accept
        self.gc = gc
        self.progress = progress
        self.env = env or simpy.Environment()  # shared by replicas behind a router
        self.gpu_queue: simpy.Store = simpy.Store(self.env)
        self.cpu_s = 0.0  # the CPU thread's clock (>= env.now while it runs ahead)
        self.num_arrived = 0
        self._wake: Event | None = None
        self.inflight: deque[Pass] = deque()
        # ngram-cpu needs the sampled tokens on the CPU every step: vLLM runs it synchronously
        self.depth = 1 if cfg.spec.method == "ngram-cpu" else cfg.batches_in_flight
        self._graphs = cfg.cuda_graphs

    # ---- processes --------------------------------------------------------------------------
    def run(self) -> None:
        self.env.run(until=self.start(own_arrivals=True))

    def start(self, own_arrivals: bool) -> simpy.Process:
        """Start the processes; with `own_arrivals` False a router calls `submit`."""
        if own_arrivals:
            self.env.process(self.arrivals())
        self.env.process(self.gpu_stream())
        return self.env.process(self.cpu_thread())

    def arrivals(self) -> Generator[Event, Any, None]:
        for req in self.requests:
            if req.arrival_s > self.env.now:
                yield self.env.timeout(req.arrival_s - self.env.now)
            self.submit(req)

    def submit(self, req: Request) -> None:
        """A request reaches this engine now (its row in `requests` is `req.index`)."""
        self.sched.add(req)
        self.num_arrived += 1
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def gpu_stream(self) -> Generator[Event, Any, None]:
        while True:
            p: Pass = yield self.gpu_queue.get()
            if p.ready_s > self.env.now:
                yield self.env.timeout(p.ready_s - self.env.now)
            p.gpu_start_s = self.env.now
            yield self.env.timeout(p.gpu_s)
            if p.counts is not p.done:
                p.counts.succeed()
            if p.draft_s > 0:
                yield self.env.timeout(p.draft_s)
            p.gpu_end_s = self.env.now
            p.done.succeed()

    def cpu_thread(self) -> Generator[Event, Any, None]:
        """The engine loop: one step per iteration."""
        total = len(self.requests)
        while self.num_arrived < total or self.sched.has_unfinished or self.inflight:
            yield from self._catch_up()  # arrivals up to the CPU clock are visible
            launched = False
            if len(self.inflight) < self.depth and self.sched.has_unfinished:
                launched = yield from self.launch_step()
            if self.inflight and (not launched or len(self.inflight) >= self.depth):
                yield from self.complete_step(self.inflight.popleft())
            elif not launched and not self.inflight:
                yield from self._idle()

    # ---- one step ---------------------------------------------------------------------------
    def launch_step(self) -> Generator[Event, Any, bool]:
        t0 = self.cpu_s
        batch = self.sched.schedule()
        shape = batch.shape if batch is not None else BatchShape()
        t = self._phase_time(P.SCHEDULE, shape)
        if batch is None:
            self.cpu_s = t  # an empty schedule still costs the scan
            return False
        step = self.rec.add_step(shape)
        self._record(step, P.SCHEDULE, t0, t)
        for r in batch.preempted:
            self.rec.preempt(r.index)
        yield from self._wait_counts(step)  # seed 5 "before": prep waits for accepted counts
        t = self._run_phase(step, P.PREPARE_INPUTS, shape)
        t = self._run_phase(step, P.LAUNCH, shape)
        gpu_s = self.cost.gpu_pass_ms(shape) / 1e3
        draft_gpu_s = self.cost.draft_gpu_ms(shape) / 1e3
        done = self.env.event()
        counts = self.env.event() if self.cfg.spec.enabled else done
        p = Pass(batch, step, t, gpu_s, draft_gpu_s, counts, done)
        self.gpu_queue.put(p)
        self._run_phase(step, P.SAMPLE, shape)
        if self.cfg.spec.method == "ngram-cpu":
            yield from self._sync(step, p.done)  # the CPU proposer needs the sampled tokens
        self._run_phase(step, P.DRAFT, shape)
        self.inflight.append(p)
        return True

    def complete_step(self, p: Pass) -> Generator[Event, Any, None]:
        yield from self._sync(p.step, p.done)
        batch = p.batch
        emitted = self.accept.emitted(batch)
        taken = self.sched.emitted_tokens(batch, emitted)
        t = self._run_phase(p.step, P.PROCESS_OUTPUTS, batch.shape)
        self.rec.gpu(p.step, p.gpu_start_s, p.gpu_end_s)
        accepted = 0
        for e, n_emit, n in zip(batch.entries, emitted, taken):
            if n:
                acc = min(n_emit - 1, n)
                accepted += n_emit - 1
                self.rec.tokens(e.req.index, t, n, acc)
            elif e.generates:
                accepted += n_emit - 1
        if accepted:
            self.rec.accepted(p.step, accepted)
        for r in self.sched.complete(batch, emitted):
            self.rec.finish(r.index, t)
        if self.progress is not None:
            self.progress(p.step)

    # ---- CPU time ---------------------------------------------------------------------------
    def _phase_time(self, phase: str, shape: BatchShape) -> float:
        """Advance the CPU clock by one phase (and any GC pause it triggers); returns the end."""
        ms = self.cost.cpu_phase_ms(phase, shape)
        if phase == P.LAUNCH:
            ms += self.cost.launch_ms(shape, self._graphs)
        self.cpu_s += ms / 1e3
        pause_s = self.gc.allocate(self.cost.alloc_objects(phase, shape))
        if pause_s:
            self.rec.gc_pause(self.cpu_s, pause_s, self.gc.last_generation, phase)
            self.cpu_s += pause_s
        return self.cpu_s

    def _run_phase(self, step: int, phase: str, shape: BatchShape) -> float:
        t0 = self.cpu_s
        t = self._phase_time(phase, shape)
        self._record(step, phase, t0, t)
        return t

    def _record(self, step: int, phase: str, t0: float, t1: float) -> None:
        self.rec.phase(step, phase, t0, t1)

    # ---- waiting ----------------------------------------------------------------------------
    def _catch_up(self) -> Generator[Event, Any, None]:
        if self.cpu_s > self.env.now:
            yield self.env.timeout(self.cpu_s - self.env.now)

    def _sync(self, step: int, done: Event) -> Generator[Event, Any, None]:
        yield from self._catch_up()
        if not done.triggered:
            t0 = self.env.now
            yield done
            self.cpu_s = self.env.now
            self.rec.sync(step, t0, self.cpu_s)
        self.cpu_s = max(self.cpu_s, self.env.now)

    def _wait_counts(self, step: int) -> Generator[Event, Any, None]:
        """Async spec decoding without optimistic mode (before PR 32951): preparing step i+1
        waits until the GPU has produced step i's accepted counts."""
        if not (self.cfg.spec.enabled and self.inflight and not self.cfg.optimistic_spec_decode):
            return
        yield from self._sync(step, self.inflight[-1].counts)

    def _idle(self) -> Generator[Event, Any, None]:
        """Nothing to run: sleep until the next arrival (not a bubble: no request is held)."""
        assert not self.sched.has_unfinished, "requests held but nothing schedulable"
        if self.num_arrived >= len(self.requests):
            return
        self._wake = self.env.event()
        yield self._wake
        self._wake = None
        self.cpu_s = max(self.cpu_s, self.env.now)
