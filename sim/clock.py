"""One engine step's physics: the CPU thread's clock through the phases, its GC pauses, its
waits on the GPU, and the in-order GPU stream.

The one definition of what a step costs in time, `StepClock.step`: the step loop
(sim.loop.SimLoop) runs it for every step it takes one by one, the fast path (sim.fast) for
every step of a run it computes in bulk, so both do the same float operations in the same
order and agree to the bit.

A step's costs come as one list in COSTS order (sim.fast.costs.StepCosts builds it from a
shape): the CPU phases' seconds (launch with launch_ms), the GPU pass's and the GPU drafter's
seconds, the phases' net tracked objects (the GC model's input), and whether the forward is
one CUDA graph. A phase of step i takes its seconds x the CPU spread's multiplier of
(i, phase) (sim.cost.spread; none: x 1 is skipped, which changes no bit) and, with a host speed
(`spread.host`, sim.cost.hostspeed), x its multiplier at the step's start (process_outputs:
at its own); with the host speed's copula (`spread.state`) the multiplier is drawn at the
host's state at those times instead, and no speed multiplies it; then any collection its
allocations trigger (the pause is part of the phase's interval, as the engine's timers see it).
Waits (`sync`) end `wake_s` after their event (cost.sync_wake_s).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bubblesim.core import phases as P
from bubblesim.core.policy import ScheduledBatch
from bubblesim.core.runfmt import RunRecorder
from sim.cost.spread import PhaseSpread
from sim.gcmodel import GCModel
from sim.stream import IdleStart, gpu_pass

# COSTS order: what StepClock.launch/complete read from a step's cost list
COSTS = (
    "schedule_s", "prepare_inputs_s", "launch_s", "sample_s", "draft_s", "process_outputs_s",
    "gpu_s", "draft_gpu_s",
    "schedule_objs", "prepare_inputs_objs", "launch_objs", "sample_objs", "draft_objs",
    "process_outputs_objs",
    "graphed",
)  # fmt: skip
NUM_SECONDS = 8  # the first eight are seconds
PO_S, PO_OBJS = COSTS.index("process_outputs_s"), COSTS.index("process_outputs_objs")
_INDEX = {p: i for i, p in enumerate(P.CPU_PHASES)}
_SCHED, _PREP, _LAUNCH = _INDEX[P.SCHEDULE], _INDEX[P.PREPARE_INPUTS], _INDEX[P.LAUNCH]
_SAMPLE, _DRAFT, _PO = _INDEX[P.SAMPLE], _INDEX[P.DRAFT], _INDEX[P.PROCESS_OUTPUTS]
NO_EVENT = float("-inf")  # `step(counts_s=...)` without a wait for the last counts
_WAIT = struct.Struct("=qdd")  # a wait kept by StepClock: (step, start_s, end_s)
_pack_wait = _WAIT.pack
_WAIT_DTYPE = np.dtype([("step", "=i8"), ("start", "=f8"), ("end", "=f8")])  # _WAIT's columns

# what `StepClock.step` returns: these CPU and GPU times (seconds)
TIMES = (
    "schedule0", "schedule1", "prepare0", "prepare1", "launch1",
    "gpu_start", "gpu_counts", "gpu_end", "sample1", "draft0", "draft1",
    "process_outputs0", "process_outputs1",
)  # fmt: skip
Times = tuple[float, ...]
LAUNCH1, GPU_START, GPU_COUNTS = (
    TIMES.index("launch1"),
    TIMES.index("gpu_start"),
    TIMES.index("gpu_counts"),
)
GPU_END, PO1 = TIMES.index("gpu_end"), TIMES.index("process_outputs1")


@dataclass(slots=True)
class Pass:
    """A launched batch: what the GPU stream runs and the CPU later syncs on."""

    batch: ScheduledBatch
    step: int  # recorder row
    ready_s: float  # launch done on the CPU: the earliest the GPU may start it
    gpu_start_s: float  # max(ready_s, end of the previous pass)
    counts_s: float  # accepted counts known (after sampling/rejection, before GPU drafting)
    gpu_end_s: float  # forward + sampling + GPU drafting done
    po_s: float  # its process_outputs' seconds and tracked objects (COSTS), spent at completion
    po_objs: int


def launched_pass(batch: ScheduledBatch, step: int, t: Times, po: tuple[float, int]) -> Pass:
    """The Pass of a launch with these times (`StepClock.step`) and process_outputs costs."""
    return Pass(batch, step, t[LAUNCH1], t[GPU_START], t[GPU_COUNTS], t[GPU_END], po[0], po[1])


class StepClock:
    """The CPU clock (`cpu_s`) and the end of the GPU stream's last pass (`gpu_free_s`).
    GC pauses and waits are kept in `pauses` and `sync_*` until `flush` records them."""

    __slots__ = ("cpu_s", "gpu_free_s", "gc", "spread", "wake_s", "idle", "cpu_ngram", "pauses",
                 "waits", "add_wait", "eager_lag_s", "other_ranks")  # fmt: skip

    def __init__(
        self, gc: GCModel, spread: PhaseSpread | None, wake_s: float, idle: IdleStart,
        cpu_ngram: bool, eager_lag_s: float = 0.0, other_ranks: int = 0,
    ) -> None:  # fmt: skip
        """`cpu_ngram`: a CPU proposer drafts from the sampled tokens, so the draft phase
        waits for its own pass. `eager_lag_s`: an eager pass ends at least this long after its
        launch does (sim.stream.gpu_pass). `other_ranks` (tensor parallelism: size - 1): each
        issues an eager step itself and the pass's all-reduces wait for the last of them: where
        its launch ends is drawn from the profile's measured `tp_ranks` fit, else each
        rank's launch from the launch spread (sim.cost.spread; with a spread only)."""
        self.cpu_s = 0.0
        self.gpu_free_s = 0.0
        self.gc = gc
        self.spread = spread
        self.wake_s = wake_s
        self.idle = idle  # a graph issued to an idle GPU runs shorter (sim.stream.IdleStart)
        self.eager_lag_s = eager_lag_s
        self.other_ranks = other_ranks
        self.cpu_ngram = cpu_ngram
        # (start_s, duration_s, generation, phase, step) of each collection
        self.pauses: list[tuple[float, float, int, str, int]] = []
        # each wait packed (_WAIT: step, start_s, end_s): one pack of hot values, and a
        # segment's many go to RunRecorder.syncs as columns of one buffer (lists converted
        # later read every int and float object again, long out of the cache; three array
        # appends convert each value, ~90 ns more a wait)
        self.waits = bytearray()
        self.add_wait = self.waits.extend

    def step(
        self, step: int, c: Sequence[Any] | None, counts_s: float = NO_EVENT,
        done_step: int = -1, done_end_s: float | None = None, po_s: float = 0.0,
        po_objs: int = 0,
    ) -> Times:  # fmt: skip
        """One iteration of the engine's loop (`Engine.step`): launch step `step`, then
        complete the oldest pass in flight. Returns the times in TIMES order (those of a part
        that did not run are meaningless).

        Launch (`c`: the step's costs in COSTS order; None: no schedule ran): schedule, [a wait
        until `counts_s`: the last pass's accepted counts, speculative decoding before vLLM
        PR 32951], prepare_inputs, launch, the GPU pass on the stream, sample, [a wait for
        that pass: the CPU proposer], draft. A schedule that found nothing has gpu_s None
        and costs its scan only. A pause in the schedule phase counts on the step before
        (the engine has not started this one).
        Complete (`done_step` >= 0; its pass ends at `done_end_s`, None: the pass launched
        here): the wait for its results, then process_outputs (`po_s` seconds, `po_objs`
        tracked objects); a pause counts on `step`, the latest step launched."""
        sp = self.spread
        t0 = cpu = self.cpu_s
        if c is None:
            sched1 = prep0 = prep1 = launch1 = sample1 = draft0 = draft1 = cpu
            start = counts = end = 0.0
        else:
            (
                s_sched, s_prep, s_launch, s_sample, s_draft, _, gpu_s, dgpu_s,
                a_sched, a_prep, a_launch, a_sample, a_draft, _, graphed,
            ) = c  # fmt: skip
            lag = self.eager_lag_s
            if sp is not None:  # no spread: no multiplication (x 1.0 would change no bit)
                # the copula (host_speed.rho): the phases drawn at the host's state at t0
                m = sp.row(step) if sp.state is None else sp.row_at(step, t0)
                s_sched *= m[_SCHED]
                s_prep *= m[_PREP]
                own = m[_LAUNCH]
                ranks = 0.0  # the last other rank's eager launch past rank 0's
                if self.other_ranks and not graphed:
                    if sp.ranks is not None:  # measured, in rank 0's launches
                        end = sp.ranks_end(step, own)
                        if end > 1.0:
                            ranks = s_launch * own * (end - 1.0)
                    else:
                        worst = sp.others_max(_LAUNCH, step, self.other_ranks, t0)
                        if worst > own:
                            ranks = s_launch * (worst - own)
                s_launch *= own
                s_sample *= m[_SAMPLE]
                s_draft *= m[_DRAFT]
                if sp.host is not None:  # the host's speed at the step's start (hostspeed.py)
                    h = sp.host.at(t0)
                    s_sched, s_prep, s_launch = s_sched * h, s_prep * h, s_launch * h
                    s_sample, s_draft = s_sample * h, s_draft * h
                    ranks *= h
                if ranks:
                    lag += ranks
            cpu += s_sched
            if a_sched > 0:  # allocations: maybe a collection
                cpu = self._collect(cpu, a_sched, P.SCHEDULE, step - 1)
            sched1 = cpu
            if gpu_s is None:  # a schedule that found nothing: its scan only
                prep0 = prep1 = launch1 = sample1 = draft0 = draft1 = cpu
                start = counts = end = 0.0
            else:
                if counts_s > cpu:
                    cpu = self._wait(step, cpu, counts_s)
                prep0 = cpu
                cpu += s_prep
                if a_prep > 0:  # allocations: maybe a collection
                    cpu = self._collect(cpu, a_prep, P.PREPARE_INPUTS, step)
                prep1 = cpu
                cpu += s_launch
                if a_launch > 0:  # allocations: maybe a collection
                    cpu = self._collect(cpu, a_launch, P.LAUNCH, step)
                launch1 = cpu
                free = self.gpu_free_s
                if graphed and cpu <= free:  # sim.stream.gpu_pass, inlined: a graph queued
                    start = free
                    counts = free + gpu_s
                else:
                    start, counts = gpu_pass(prep1, cpu, free, gpu_s, graphed, self.idle, lag)
                end = self.gpu_free_s = counts + dgpu_s if dgpu_s > 0 else counts
                cpu += s_sample
                if a_sample > 0:  # allocations: maybe a collection
                    cpu = self._collect(cpu, a_sample, P.SAMPLE, step)
                sample1 = cpu
                if self.cpu_ngram and end > cpu:  # the CPU proposer needs the sampled tokens
                    cpu = self._wait(step, cpu, end)
                draft0 = cpu
                cpu += s_draft
                if a_draft > 0:  # allocations: maybe a collection
                    cpu = self._collect(cpu, a_draft, P.DRAFT, step)
                draft1 = cpu
        po0 = cpu
        if done_step >= 0:
            if done_end_s is None:
                done_end_s = end
            if done_end_s > cpu:  # _wait, inlined: most steps of a GPU-bound run wait here
                end_s = done_end_s + self.wake_s
                self.add_wait(_pack_wait(done_step, cpu, end_s))
                cpu = end_s
            po0 = cpu
            if sp is not None:
                if sp.state is None:
                    po_s *= sp.at(_PO, done_step)
                else:  # the copula: at the host's state at the phase's start
                    po_s *= sp.at_time(_PO, done_step, cpu)
                if sp.host is not None:  # the host's speed at the phase's start
                    po_s *= sp.host.at(cpu)
            cpu += po_s
            if po_objs > 0:  # _collect, inlined: most steps allocate here, few collect
                gc = self.gc
                if po_objs <= gc.room:  # no collection: GCModel.allocate's whole work
                    gc.room -= po_objs
                else:
                    pause = gc.allocate(po_objs)
                    if pause:
                        self.pauses.append(
                            (cpu, pause, gc.last_generation, P.PROCESS_OUTPUTS, step)
                        )
                        cpu += pause
        self.cpu_s = cpu
        return (
            t0, sched1, prep0, prep1, launch1, start, counts, end, sample1, draft0, draft1,
            po0, cpu,
        )  # fmt: skip

    def _collect(self, cpu: float, objs: int, phase: str, step: int) -> float:
        """A phase ending at `cpu` leaves `objs` tracked objects; a collection they trigger
        pauses the thread there (recorded on `step`). Returns the clock after it."""
        pause = self.gc.allocate(objs)
        if not pause:
            return cpu
        self.pauses.append((cpu, pause, self.gc.last_generation, phase, step))
        return cpu + pause

    def _wait(self, step: int, cpu: float, event_s: float) -> float:
        """A host waiting from `cpu` resumes `wake_s` after the event (the result's copy and
        the wake-up: ~0.5 ms measured on an H100 host, cost.sync_wake_s, default 0)."""
        end = event_s + self.wake_s
        self.add_wait(_pack_wait(step, cpu, end))
        return end

    def flush(self, rec: RunRecorder) -> None:
        """Record the pauses and waits kept so far, in order, and forget them."""
        waits = self.waits
        if len(waits) > _WAIT.size:  # many: as columns (copied by `syncs`)
            cols = np.frombuffer(waits, _WAIT_DTYPE)
            rec.syncs(cols["step"], cols["start"], cols["end"])
            del cols  # (the view holds the buffer)
            del waits[:]
        elif waits:
            rec.sync(*_WAIT.unpack(waits))
            del waits[:]
        if self.pauses:
            for start_s, dur_s, gen, phase, step in self.pauses:
                rec.gc_pause(start_s, dur_s, gen, phase, step)
            self.pauses.clear()
