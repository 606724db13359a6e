"""The engine step loop as a SimPy process: one CPU thread and one in-order GPU stream.

The CPU thread mirrors `engine.Engine.step` phase for phase:

    schedule -> prepare_inputs -> launch -> sample -> draft        (while < depth in flight)
    [sync on the oldest batch] -> process_outputs                   (when depth are in flight)

The GPU stream runs passes in launch order: pass j starts at max(launch_end_j, gpu_end_{j-1})
and its end is known the moment it is launched, so the stream needs no process of its own: a
`Pass` carries its GPU times and a sync point is an explicit edge, `cpu = max(cpu, event_s)`
(recorded as a sync wait when the CPU gets there first).
The CPU thread keeps its own clock `self.cpu_s`. With its own arrivals (`run()`), nothing else
shares the model, so it reads arrivals straight from the sorted request list and never yields
inside a step; behind a router (`start(own_arrivals=False)` + `submit`) it yields to SimPy at
each step's top so that requests submitted up to its clock are visible to `schedule()`.
Runs of identical decode steps are computed in bulk by `sim.fastforward` (with speculative
decoding: runs of verify steps by `sim.specforward`, single steps fused by `sim.specstep`) with
the same arithmetic, so the result is the same bit for bit (tests/test_sim_fastforward.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import simpy

from core import phases as P
from core.config import Config
from core.policy import ScheduledBatch, Scheduler
from core.request import Request
from core.runfmt import RunRecorder
from core.shape import BatchShape
from sim.acceptance import AcceptanceModel
from sim.cost import CostModel
from sim.cost.spread import PhaseSpread, phase_spread
from sim.gcmodel import GCModel
from sim.stream import gpu_pass

if TYPE_CHECKING:
    from sim.fastforward import FastForward
    from sim.specforward import SpecForward
    from sim.specstep import SpecSteps

Event = simpy.events.Event
_EMPTY = BatchShape()
_INF = float("inf")
_PHASE_INDEX = {p: i for i, p in enumerate(P.CPU_PHASES)}


@dataclass(slots=True)
class Pass:
    """A launched batch: what the GPU stream runs and the CPU later syncs on."""

    batch: ScheduledBatch
    step: int  # recorder row
    ready_s: float  # launch done on the CPU: the earliest the GPU may start it
    gpu_start_s: float  # max(ready_s, end of the previous pass)
    counts_s: float  # accepted counts known (after sampling/rejection, before GPU drafting)
    gpu_end_s: float  # forward + sampling + GPU drafting done


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
        self.accept = accept
        self.gc = gc
        self.progress = progress
        # when `progress` next wants to look (an SLO check): a fast-forward segment ends with
        # the first step it completes at or after this CPU time, so the hook then sees what it
        # would see called after every step
        self.tick_at_s = _INF
        self.env = env or simpy.Environment()  # shared by replicas behind a router
        self.cpu_s = 0.0  # the CPU thread's clock (>= env.now while it runs ahead)
        self.gpu_free_s = 0.0  # end of the last pass launched on the GPU stream
        self.num_arrived = 0
        # most requests running at once (running grows only by admission): a run where it
        # stays below max_num_seqs never met that limit, and is the run of any limit above it
        self.peak_running = 0
        self.next_arrival = 0  # own arrivals: index of the next request to submit
        self.own_arrivals = False
        self.check = check_invariants
        self._wake: Event | None = None
        self.inflight: deque[Pass] = deque()
        self.depth = cfg.depth  # 1 with ngram-cpu (synchronous, as vLLM), else batches_in_flight
        self._graphs = cfg.cuda_graphs
        self._spec = cfg.spec.enabled
        self._wait_for_counts = self._spec and not cfg.optimistic_spec_decode
        self._cpu_ngram = cfg.spec.method == "ngram-cpu"
        # the profile's measured CPU spread: one multiplier per (step, phase), None without
        self.spread: PhaseSpread | None = phase_spread(cost.profile, cfg.seed, stream)
        # Runs of decode steps in bulk (sim/fastforward.py), with own arrivals only: behind a
        # router the next submit is unknown. Drafts vary per step, so none with spec decoding:
        # its steps are fused instead (sim/specstep.py), whoever feeds the replica.
        self.ff: FastForward | SpecForward | None = None
        self.spec_steps: SpecSteps | None = None
        if fast_forward and not self._spec:
            from sim.fastforward import FastForward

            self.ff = FastForward(self)
        elif fast_forward:
            from sim.specforward import SpecForward
            from sim.specstep import SpecSteps

            self.ff = SpecForward(self)
            self.spec_steps = SpecSteps(self)

    # ---- processes --------------------------------------------------------------------------
    def run(self) -> None:
        self.env.run(until=self.start(own_arrivals=True))

    def start(self, own_arrivals: bool) -> simpy.Process:
        """Start the CPU thread; with `own_arrivals` False a router calls `submit`."""
        self.own_arrivals = own_arrivals
        return self.env.process(self.cpu_thread())

    def submit(self, req: Request) -> None:
        """A request reaches this engine now (its row in `requests` is `req.index`)."""
        self.sched.add(req)
        self.num_arrived += 1
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def cpu_thread(self) -> Generator[Event, Any, None]:
        """The engine loop: one step per iteration."""
        total = len(self.requests)
        sched = self.sched
        while self.num_arrived < total or sched.has_unfinished or self.inflight:
            if self.own_arrivals:
                self._take_arrivals()  # arrivals up to the CPU clock are visible
            elif self.cpu_s > self.env.now:
                yield self.env.timeout(self.cpu_s - self.env.now)
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
        t0 = self.cpu_s
        batch = None if self.spec_steps is None else self.spec_steps.schedule()
        if batch is None:
            batch = self.sched.schedule()
        if len(self.sched.running) > self.peak_running:
            self.peak_running = len(self.sched.running)
        shape = batch.shape if batch is not None else _EMPTY
        t = self._phase_time(P.SCHEDULE, shape, self.rec.num_steps)
        if batch is None:
            return False  # an empty schedule still costs the scan
        rec = self.rec
        step = rec.add_step(shape)
        rec.phase(step, P.SCHEDULE, t0, t)
        for r in batch.preempted:
            rec.preempt(r.index)
        if self._wait_for_counts and self.inflight:
            # spec decoding before PR 32951: prep waits for the previous step's accepted counts
            self._sync(step, self.inflight[-1].counts_s)
        launch_s = self._run_phase(step, P.PREPARE_INPUTS, shape)
        ready = self._run_phase(step, P.LAUNCH, shape)
        cost = self.cost
        start, counts = gpu_pass(
            launch_s, ready, self.gpu_free_s, cost.gpu_pass_ms(shape) / 1e3,
            cost.graphed(shape, self._graphs), cost.idle_start_scale, cost.idle_start_min_s,
        )  # fmt: skip
        draft_s = self.cost.draft_gpu_ms(shape) / 1e3
        end = counts + draft_s if draft_s > 0 else counts
        self.gpu_free_s = end
        p = Pass(batch, step, ready, start, counts, end)
        self._run_phase(step, P.SAMPLE, shape)
        if self._cpu_ngram:
            self._sync(step, end)  # the CPU proposer needs the sampled tokens
        self._run_phase(step, P.DRAFT, shape)
        self.inflight.append(p)
        if self.check:
            self.sched.check_invariants()
        return True

    def complete_step(self, p: Pass) -> None:
        if self.spec_steps is not None:
            self.spec_steps.complete(p)  # the same, fused
            return
        self._sync(p.step, p.gpu_end_s)
        batch = p.batch
        entries = batch.entries
        emitted = self.accept.emitted(batch) if self._spec else [1] * len(entries)
        taken = self.sched.emitted_tokens(batch, emitted)
        t = self._run_phase(p.step, P.PROCESS_OUTPUTS, batch.shape)
        rec = self.rec
        rec.gpu(p.step, p.gpu_start_s, p.gpu_end_s)
        if self._spec:
            self._record_spec_tokens(p.step, entries, emitted, taken, t)
        else:
            tokens = rec.tokens
            for e, n in zip(entries, taken):
                if n:
                    tokens(e.req.index, t, n, 0)
        for r in self.sched.complete(batch, emitted):
            rec.finish(r.index, t)
        if self._cpu_ngram:
            self._draft_hints(entries)
        if self.check:
            self.sched.check_invariants()
        if self.progress is not None:
            self.progress(p.step)

    def _draft_hints(self, entries: list[Any]) -> None:
        """The synchronous CPU proposer schedules only the drafts it found (the engine sets the
        same hint), so verify passes carry as many draft tokens as in the real run."""
        accept = self.accept
        for e in entries:
            r = e.req
            if e.generates and not r.is_finished and accept.has_ids(r):
                r.draft_hint = len(accept.drafts_at(r, r.prompt_len + r.num_output_tokens))

    def _record_spec_tokens(
        self, step: int, entries: list[Any], emitted: list[int], taken: list[int], t: float
    ) -> None:
        accepted = 0
        for e, n_emit, n in zip(entries, emitted, taken):
            if n:
                accepted += n_emit - 1
                self.rec.tokens(e.req.index, t, n, min(n_emit - 1, n))
            elif e.generates:
                accepted += n_emit - 1
        if accepted:
            self.rec.accepted(step, accepted)

    # ---- CPU time ---------------------------------------------------------------------------
    def _phase_time(self, phase: str, shape: BatchShape, step: int) -> float:
        """Advance the CPU clock by one phase of `step` (and any GC pause it triggers); returns
        the end. With a CPU spread the phase's seconds are scaled by the step's multiplier."""
        ms = self.cost.cpu_phase_ms(phase, shape)
        if phase == P.LAUNCH:
            ms += self.cost.launch_ms(shape, self._graphs)
        if self.spread is None:
            self.cpu_s += ms / 1e3
        else:
            self.cpu_s += ms / 1e3 * self.spread.at(_PHASE_INDEX[phase], step)
        pause_s = self.gc.allocate(self.cost.alloc_objects(phase, shape))
        if pause_s:
            self.rec.gc_pause(self.cpu_s, pause_s, self.gc.last_generation, phase)
            self.cpu_s += pause_s
        return self.cpu_s

    def _run_phase(self, step: int, phase: str, shape: BatchShape) -> float:
        t0 = self.cpu_s
        t = self._phase_time(phase, shape, step)
        self.rec.phase(step, phase, t0, t)
        return t

    # ---- waiting ----------------------------------------------------------------------------
    def _sync(self, step: int, event_s: float) -> None:
        """The CPU blocks until the GPU reaches `event_s` (a recorded wait if it is early); a
        waiting host resumes `sync_wake_s` after the event (the result's copy and the wake-up:
        ~0.5 ms measured on an H100 host, cost.sync_wake_s, default 0)."""
        if event_s > self.cpu_s:
            end = event_s + self.cost.sync_wake_s
            self.rec.sync(step, self.cpu_s, end)
            self.cpu_s = end

    def _take_arrivals(self) -> None:
        reqs, i, n, now = self.requests, self.next_arrival, len(self.requests), self.cpu_s
        while i < n and reqs[i].arrival_s <= now:
            self.submit(reqs[i])
            i += 1
        self.next_arrival = i

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
            self.cpu_s = max(self.cpu_s, self.next_arrival_s())
            return
        self._wake = self.env.event()
        yield self._wake
        self._wake = None
        self.cpu_s = max(self.cpu_s, self.env.now)
