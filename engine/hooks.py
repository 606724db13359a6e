"""Phase timing hooks: a cheap recorder of the step loop that replay reads after a run.

One row per launched batch (in launch order; row == the batch's `ScheduledBatch.step`):
- `phase_ns[row, p]` = (start, end) of CPU phase `CPU_PHASES[p]`, -1 where absent. A batch's
  `process_outputs` lands in its own row, possibly several loop iterations after its launch.
- `gpu_ns[row]` = (start, end) of the batch's GPU work on the compute stream, from two CUDA events
  (before the first and after the last kernel of the step); on CPU, host times around the work.
- `mark_ns[row, m]` = GPU time of mark m (`MARKS`: before the forward, after it, before the GPU
  drafter's kernels) and `mark_host_ns[row, m]` = when the host enqueued it, -1 where absent:
  what lets replay tell the step's kernel time from GPU waits for the host inside its interval
  (`replay.gpu.measure.kernel_busy`). A CUDA graph runs without the host, so the forward's span is
  kernels only; the time between the start event and the forward is the input copies plus any
  wait for the host to issue the forward.
- `broadcast_ns[row]` = (start, end) of the tensor-parallel step broadcast (`bubblesim.core.phases.
  BROADCAST`: rank 0 sends the step's header and inputs to the other ranks), -1 where absent
  (always at tensor_parallel_size 1). Its own column whether or not BROADCAST is one of
  CPU_PHASES; when it is, the same interval is also the phase's column of `phase_ns` (and GC
  pauses during it name it as their activity).
- sync waits (`sync_ns`, `sync_row`) and GC pauses (`gc_ns`, generation, the activity that was
  running as an index into `ALL_CPU_ACTIVITIES` or -1, the newest row) are append-only columns.
All times are `time.perf_counter_ns()`. GPU event times are put on that clock through two
anchors, a base event recorded on the idle device in `start()` and another in `finish()` (each
the host time halfway between its record and its synchronize's return, retried until that
window is under ANCHOR_WINDOW_NS): an event's host time is the base's plus its GPU time since
the base x the rate between the anchors. The GPU's timer and the host's clock run at rates that
differ by tens of ppm (H100 hosts, 2026-11-26: the GPU's clock fell behind by 6-25 us a
second, up to a millisecond over a 45 s run), so one anchor alone shifts every late GPU time
by up to that much against the host's phases. Until `finish()` the harvested GPU times are
held as ns since the base on the GPU's clock; `finish()` maps them.

Cost (bench/hooks_overhead.py): the per-row columns are preallocated flat `array`s that grow by
doubling (an item store costs about what a numpy scalar store does, and unlike a list of ints
they hold no objects, so the collector whose pauses we measure has nothing more to traverse); a
`begin`/`end` pair is two perf_counter_ns calls and two array stores. CUDA events: a ring of
`ring` pairs, created (recorded once) when the hooks are built, recorded on the stream that was
current at `start()` (the engine's one compute stream) through the C methods, without the
`current_stream()` lookup `Event.record()` makes per call, and read (`elapsed_time`, which never
blocks) only once they are long done: when their ring slot is reused, `ring` steps later, or in
`finish()`. A ring longer than the run (replay sizes it so) leaves every read to `finish()`. No
dicts or objects per step; numpy arrays are built once, in `finish()`.
"""

from __future__ import annotations

import contextlib
import gc
import time
from array import array
from dataclasses import dataclass, field

import numpy as np
import torch

from bubblesim.core.phases import ALL_CPU_ACTIVITIES, BROADCAST, CPU_PHASES, SYNC
from bubblesim.core.shape import BatchShape
from engine.tp.ranktimes import empty_table

PHASE = {name: i for i, name in enumerate(CPU_PHASES)}  # CPU phase -> column of phase_ns
ACTIVITY = {name: i for i, name in enumerate(ALL_CPU_ACTIVITIES)}  # gc_activity codes
_SYNC = ACTIVITY[SYNC]
_BCAST = ACTIVITY.get(BROADCAST, -1)  # -1: not one of CPU_PHASES, own column only
_NP = len(CPU_PHASES)
MARKS = ("forward_begin", "forward_end", "draft_begin")  # mark_ns columns
FORWARD_BEGIN, FORWARD_END, DRAFT_BEGIN = range(len(MARKS))
_NM = len(MARKS)
_now = time.perf_counter_ns
ANCHOR_WINDOW_NS = 50_000  # an anchor's record-to-synchronize window is retried above this
ANCHOR_TRIES = 8


@dataclass
class StepTrace:
    """What the hooks recorded, as numpy arrays (times in perf_counter ns, -1 = absent)."""

    t0_ns: int  # when `start()` ran: the run's zero
    phase_ns: np.ndarray  # int64 [n, len(CPU_PHASES), 2]
    gpu_ns: np.ndarray  # int64 [n, 2]
    shapes: list[BatchShape]  # [n]
    mark_ns: np.ndarray  # int64 [n, len(MARKS)]: GPU time of each mark, -1 = absent
    mark_host_ns: np.ndarray  # int64 [n, len(MARKS)]: when the host enqueued it
    finished: np.ndarray  # int32 [n]: requests finished by the row's results
    graphed: np.ndarray  # int8 [n]: 1 where the row's forward was a CUDA graph replay
    sync_ns: np.ndarray  # int64 [s, 2]
    sync_row: np.ndarray  # int64 [s]
    gc_ns: np.ndarray  # int64 [g, 2]
    gc_generation: np.ndarray  # int64 [g]
    gc_activity: np.ndarray  # int64 [g]: index into ALL_CPU_ACTIVITIES, -1 = outside any
    gc_row: np.ndarray  # int64 [g]: newest row when the pause began (-1 = before any)
    # int64 [n, 2]: the tensor-parallel step broadcast of each row, -1 = absent
    broadcast_ns: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    # CUDA: how GPU times were put on the host clock (StepHooks.finish; empty on CPU)
    clock: dict[str, float] = field(default_factory=dict)
    # int64 [m, 5]: the worker ranks' own launches (engine.tp.ranktimes.COLUMNS: rank, this
    # trace's row, header received, launch start and end), empty without tensor parallelism
    rank_ns: np.ndarray = field(default_factory=empty_table)

    @property
    def num_steps(self) -> int:
        return len(self.shapes)

    def gpu_busy_fraction(self, first: int = 0, last: int | None = None) -> float:
        """GPU busy time / wall time over rows first..last (GPU intervals never overlap)."""
        g = self.gpu_ns[first:last]
        g = g[g[:, 0] >= 0]
        if len(g) == 0:
            return 0.0
        wall = g[-1, 1] - g[0, 0]
        return float((g[:, 1] - g[:, 0]).sum() / wall) if wall > 0 else 1.0


def _col(a: array[int], n: int | None = None) -> np.ndarray:
    """The first n values of an int64 array as a numpy copy (a view would pin its size)."""
    return np.frombuffer(a, np.int64, len(a) if n is None else n).copy()


def _filled(code: str, value: int, n: int) -> array[int]:
    return array(code, [value]) * n


class StepHooks:
    """Row-major flat columns (row r, phase p, edge e at `_phase[(r * _NP + p) * 2 + e]`, GPU
    edge e at `_gpu[2 * r + e]`) of `_cap` rows; `finished[row]` and `graphed[row]` are stored
    by the engine."""

    def __init__(self, device: torch.device, capacity: int = 1024, ring: int = 256) -> None:
        """`capacity`: rows before the first doubling; `ring`: CUDA event pairs (steps whose
        GPU times are read only in `finish()`)."""
        self.cuda = device.type == "cuda"
        self._capacity = max(1, capacity)
        self._ring = max(1, ring)
        self.reset()
        self.activity = -1  # what the CPU thread is doing now (ACTIVITY code), for GC pauses
        self._t0 = 0
        self._gc_t0 = 0
        self._base_ns = 0
        self._base_window_ns = 0
        self.stream = None  # CUDA: the stream step events go to (the C record needs one)
        self.clock: dict[str, float] = {}
        if self.cuda:
            self._base = torch.cuda.Event(enable_timing=True)
            self._base_end = torch.cuda.Event(enable_timing=True)
            self._ev_start = [torch.cuda.Event(enable_timing=True) for _ in range(self._ring)]
            self._ev_end = [torch.cuda.Event(enable_timing=True) for _ in range(self._ring)]
            self._ev_mark = [
                torch.cuda.Event(enable_timing=True) for _ in range(_NM * self._ring)
            ]  # ring slot k, mark m at k * _NM + m
            # the C methods behind Event.record(stream) / Event.elapsed_time (one Python frame
            # and, for record, a current_stream() lookup less per call): `record_event(event,
            # stream)` and `elapsed_ms(base, event)` (milliseconds from base to event) are
            # public so a benchmark can swap in the Python-level methods
            base = torch._C._CudaEventBase
            self.record_event = getattr(base, "record", torch.cuda.Event.record)
            self.elapsed_ms = getattr(base, "elapsed_time", torch.cuda.Event.elapsed_time)
            self.stream = torch.cuda.current_stream()  # until start() takes it again
            for ev in (
                self._ev_start + self._ev_end + self._ev_mark
            ):  # CUDA creates an event on its first
                self.record_event(ev, self.stream)  # record: here, not in a step

    def reset(self) -> None:
        """Forget every row (a new run)."""
        self.num_steps = 0
        cap = self._cap = self._capacity
        self._phase = _filled("q", -1, 2 * _NP * cap)
        self._gpu = _filled("q", -1, 2 * cap)
        self._mark = _filled("q", -1, _NM * cap)
        self._mark_host = _filled("q", -1, _NM * cap)
        self._bcast = _filled("q", -1, 2 * cap)
        self.finished = _filled("i", 0, cap)
        self.graphed = _filled("b", 0, cap)
        self.shapes: list[BatchShape] = []
        self.sync_ns = array("q")  # start, end, start, end, ...
        self.sync_row = array("q")
        self.gc_ns = array("q")  # start, end, ...
        self.gc_generation = array("q")
        self.gc_activity = array("q")
        self.gc_row = array("q")
        self._ring_row = _filled("q", -1, self._ring)  # row whose events a slot holds
        self._ring_ended = _filled("b", 0, self._ring)  # 1: the row's end event is recorded
        self._ring_marks = _filled("b", 0, _NM * self._ring)  # 1: mark recorded in this use
        self.t0_ns = _now()

    def _grow(self) -> None:
        """Double the row capacity in place."""
        cap = self._cap
        self._phase.extend(_filled("q", -1, 2 * _NP * cap))
        self._gpu.extend(_filled("q", -1, 2 * cap))
        self._mark.extend(_filled("q", -1, _NM * cap))
        self._mark_host.extend(_filled("q", -1, _NM * cap))
        self._bcast.extend(_filled("q", -1, 2 * cap))
        self.finished.extend(_filled("i", 0, cap))
        self.graphed.extend(_filled("b", 0, cap))
        self._cap = 2 * cap

    # ---- run boundaries ----------------------------------------------------------------------
    def start(self) -> int:
        """Reset, and take the run's zero; on CUDA also the base event for GPU times and the
        stream the step events are recorded on (the current one: the engine's compute stream)."""
        self.reset()
        if self.cuda:
            self.stream = torch.cuda.current_stream()
            self._base_ns, self._base_window_ns = self._anchor(self._base)
        self.t0_ns = _now()
        return self.t0_ns

    def _anchor(self, ev: torch.cuda.Event) -> tuple[int, int]:
        """Record `ev` on the idle device; (its host time, the record-to-return window it lies
        in). Re-recorded while the window is wider than ANCHOR_WINDOW_NS (a slow wake-up), at
        most ANCHOR_TRIES times: the event holds the last recording, so the last try counts."""
        for _ in range(ANCHOR_TRIES):
            torch.cuda.synchronize()
            t_a = _now()
            ev.record(self.stream)
            ev.synchronize()
            t_b = _now()
            if t_b - t_a <= ANCHOR_WINDOW_NS:
                break
        return (t_a + t_b) // 2, t_b - t_a

    def _map_gpu_times(self) -> None:
        """Put the harvested GPU times (ns since the base, GPU clock) on the host clock, with
        the rate between the start and end anchors (module docstring)."""
        rate = 1.0
        try:
            end_ns, window = self._anchor(self._base_end)
            gpu_span_ns = self.elapsed_ms(self._base, self._base_end) * 1e6
        except RuntimeError:  # a failed device: one anchor only
            end_ns, window, gpu_span_ns = 0, 0, 0.0
        host_span_ns = end_ns - self._base_ns
        if gpu_span_ns > 1e8 and host_span_ns > 0:  # >= 0.1 s apart: a rate worth fitting
            rate = host_span_ns / gpu_span_ns
        self.clock = {
            "host_per_gpu_ns": rate,
            "drift_ppm": (rate - 1.0) * 1e6,
            "span_s": gpu_span_ns / 1e9,
            "anchor_window_us": max(self._base_window_ns, window) / 1e3,
        }
        for a, n in ((self._gpu, 2 * self.num_steps), (self._mark, _NM * self.num_steps)):
            v = np.frombuffer(a, np.int64, n)  # a view: writes go to the array
            have = v >= 0
            v[have] = self._base_ns + np.round(v[have] * rate).astype(np.int64)
            del v  # the array may grow again (a view would pin its size)

    def finish(self) -> StepTrace:
        """Read every outstanding GPU event (synchronizes the device) and freeze the record.
        After an engine error it still returns what could be read."""
        if self.cuda:
            with contextlib.suppress(RuntimeError):  # a failed device: keep what is readable
                torch.cuda.synchronize()
            for k in range(min(self._ring, self.num_steps)):
                self._harvest(k)
            if self._base_ns:
                self._map_gpu_times()
                self._base_ns = 0  # mapped once: a second finish() leaves them as they are
        n = self.num_steps
        return StepTrace(
            t0_ns=self.t0_ns,
            phase_ns=_col(self._phase, 2 * _NP * n).reshape(n, _NP, 2),
            gpu_ns=_col(self._gpu, 2 * n).reshape(n, 2),
            shapes=list(self.shapes),
            mark_ns=_col(self._mark, _NM * n).reshape(n, _NM),
            mark_host_ns=_col(self._mark_host, _NM * n).reshape(n, _NM),
            finished=np.frombuffer(self.finished, np.int32, n).copy(),
            graphed=np.frombuffer(self.graphed, np.int8, n).copy(),
            sync_ns=_col(self.sync_ns).reshape(-1, 2),
            sync_row=_col(self.sync_row),
            gc_ns=_col(self.gc_ns).reshape(-1, 2),
            gc_generation=_col(self.gc_generation),
            gc_activity=_col(self.gc_activity),
            gc_row=_col(self.gc_row),
            broadcast_ns=_col(self._bcast, 2 * n).reshape(n, 2),
            clock=dict(self.clock),
        )

    # ---- CPU phases --------------------------------------------------------------------------
    def begin(self, phase: str) -> None:
        self.activity = ACTIVITY[phase]
        self._t0 = _now()

    def end(self, row: int) -> None:
        """Close the phase opened by `begin` and store it in `row`."""
        i = (row * _NP + self.activity) << 1
        p = self._phase
        p[i] = self._t0
        p[i + 1] = _now()
        self.activity = -1

    def begin_broadcast(self) -> None:
        """Open the step broadcast (tensor parallelism): a phase like the others where BROADCAST
        is one of CPU_PHASES, else outside any activity."""
        self.activity = _BCAST
        self._t0 = _now()

    def end_broadcast(self, row: int) -> None:
        t1 = _now()
        b = self._bcast
        b[2 * row] = self._t0
        b[2 * row + 1] = t1
        if _BCAST >= 0:
            i = (row * _NP + _BCAST) << 1
            self._phase[i] = self._t0
            self._phase[i + 1] = t1
        self.activity = -1

    def cancel(self) -> None:
        """Drop the open phase (a schedule that found nothing to run is not a step)."""
        self.activity = -1

    def new_row(self, shape: BatchShape) -> int:
        row = self.num_steps
        if row == self._cap:
            self._grow()
        self.shapes.append(shape)
        self.num_steps = row + 1
        return row

    def sync_begin(self) -> int:
        self.activity = _SYNC
        return _now()

    def sync_end(self, row: int, t0: int) -> None:
        s = self.sync_ns
        s.append(t0)
        s.append(_now())
        self.sync_row.append(row)
        self.activity = -1

    # ---- GPU intervals -----------------------------------------------------------------------
    def gpu_begin(self, row: int) -> None:
        """Call on the host right before the step's first GPU work is enqueued."""
        if not self.cuda:
            self._gpu[2 * row] = _now()
            return
        k = row % self._ring
        if self._ring_row[k] >= 0:
            self._harvest(k)  # recorded `ring` steps ago: long done
        self._ring_row[k] = row
        self._ring_ended[k] = 0
        for m in range(k * _NM, k * _NM + _NM):
            self._ring_marks[m] = 0
        self.record_event(self._ev_start[k], self.stream)

    def mark(self, row: int, m: int) -> None:
        """Mark m (`MARKS`) of `row`'s GPU work, between its `gpu_begin` and `gpu_end`: call
        on the host right where the work it separates is enqueued."""
        i = _NM * row + m
        if not self.cuda:
            self._mark[i] = self._mark_host[i] = _now()
            return
        j = (row % self._ring) * _NM + m
        self.record_event(self._ev_mark[j], self.stream)
        self._mark_host[i] = _now()
        self._ring_marks[j] = 1

    def gpu_end(self, row: int) -> None:
        """Call right after the step's last GPU work on the compute stream is enqueued."""
        if not self.cuda:
            self._gpu[2 * row + 1] = _now()
            return
        k = row % self._ring
        self.record_event(self._ev_end[k], self.stream)
        self._ring_ended[k] = 1

    def _harvest(self, k: int) -> None:
        """Read ring slot k's events into its row. A step cut short (an error between its two
        marks) or events that cannot be read (a failed device) leave the row at -1."""
        row = self._ring_row[k]
        if row < 0:
            return
        self._ring_row[k] = -1
        if not self._ring_ended[k] or not self._base_ns:  # cut short, or before start()
            return
        try:
            t0 = self.elapsed_ms(self._base, self._ev_start[k])
            t1 = self.elapsed_ms(self._base, self._ev_end[k])
        except RuntimeError:
            return
        self._gpu[2 * row] = int(t0 * 1e6)  # GPU ns since the base: finish() maps them
        self._gpu[2 * row + 1] = int(t1 * 1e6)
        for m in range(_NM):
            j = k * _NM + m
            if self._ring_marks[j]:
                try:
                    t = self.elapsed_ms(self._base, self._ev_mark[j])
                except RuntimeError:
                    continue
                self._mark[_NM * row + m] = int(t * 1e6)

    # ---- GC pauses ---------------------------------------------------------------------------
    def install_gc(self) -> None:
        if self.on_gc not in gc.callbacks:
            gc.callbacks.append(self.on_gc)

    def remove_gc(self) -> None:
        if self.on_gc in gc.callbacks:
            gc.callbacks.remove(self.on_gc)

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """The `gc.callbacks` callback `install_gc` registers: "start" takes the time, "stop"
        stores the pause (ns) with `info["generation"]`, the current activity and the latest
        row. Public so its cost can be timed alone."""
        if phase == "start":
            self._gc_t0 = _now()
            return
        self.gc_ns.append(self._gc_t0)
        self.gc_ns.append(_now())
        self.gc_generation.append(info["generation"])
        self.gc_activity.append(self.activity)
        self.gc_row.append(self.num_steps - 1)


__all__ = ["ACTIVITY", "MARKS", "PHASE", "StepHooks", "StepTrace"]
