"""Phase timing hooks: a cheap recorder of the step loop that replay reads after a run.

One row per launched batch (in launch order; row == the batch's `ScheduledBatch.step`):
- `phase_ns[row, p]` = (start, end) of CPU phase `CPU_PHASES[p]`, -1 where absent. A batch's
  `process_outputs` lands in its own row, possibly several loop iterations after its launch.
- `gpu_ns[row]` = (start, end) of the batch's GPU work on the compute stream, from two CUDA events
  (before the first and after the last kernel of the step); on CPU, host times around the work.
- sync waits (`sync_ns`, `sync_row`) and GC pauses (`gc_ns`, generation, the activity that was
  running as an index into `ALL_CPU_ACTIVITIES` or -1, the newest row) are append-only columns.
All times are `time.perf_counter_ns()`; GPU event times are put on that clock through a base
event recorded right after a device synchronize in `start()`.

Cost: a `begin`/`end` pair is two perf_counter_ns calls and two numpy stores; CUDA events are
kept in a ring and read (`elapsed_time`, which never blocks) only once they are long done: when
their ring slot is reused, 256 steps later, or in `finish()`. No dicts or objects per step.
"""

from __future__ import annotations

import contextlib
import gc
import time
from array import array
from dataclasses import dataclass

import numpy as np
import torch

from core.phases import ALL_CPU_ACTIVITIES, CPU_PHASES, SYNC
from core.shape import BatchShape

PHASE = {name: i for i, name in enumerate(CPU_PHASES)}  # CPU phase -> column of phase_ns
ACTIVITY = {name: i for i, name in enumerate(ALL_CPU_ACTIVITIES)}  # gc_activity codes
_SYNC = ACTIVITY[SYNC]
_NP = len(CPU_PHASES)
_now = time.perf_counter_ns


@dataclass
class StepTrace:
    """What the hooks recorded, as numpy arrays (times in perf_counter ns, -1 = absent)."""

    t0_ns: int  # when `start()` ran: the run's zero
    phase_ns: np.ndarray  # int64 [n, len(CPU_PHASES), 2]
    gpu_ns: np.ndarray  # int64 [n, 2]
    shapes: list[BatchShape]  # [n]
    finished: np.ndarray  # int32 [n]: requests finished by the row's results
    sync_ns: np.ndarray  # int64 [s, 2]
    sync_row: np.ndarray  # int64 [s]
    gc_ns: np.ndarray  # int64 [g, 2]
    gc_generation: np.ndarray  # int64 [g]
    gc_activity: np.ndarray  # int64 [g]: index into ALL_CPU_ACTIVITIES, -1 = outside any
    gc_row: np.ndarray  # int64 [g]: newest row when the pause began (-1 = before any)

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


class StepHooks:
    def __init__(self, device: torch.device, capacity: int = 1024, ring: int = 256) -> None:
        self.cuda = device.type == "cuda"
        self._capacity = capacity
        self._ring = ring
        self.reset()
        self.activity = -1  # what the CPU thread is doing now (ACTIVITY code), for GC pauses
        self._t0 = 0
        self._gc_t0 = 0
        if self.cuda:
            self._base = torch.cuda.Event(enable_timing=True)
            self._ev = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(ring)
            ]
        self._base_ns = 0

    def reset(self) -> None:
        """Forget every row (a new run)."""
        self.num_steps = 0
        self._alloc(self._capacity)
        self.shapes: list[BatchShape] = []
        self.sync_ns: array[int] = array("q")
        self.sync_row: array[int] = array("q")
        self.gc_ns: array[int] = array("q")
        self.gc_generation: array[int] = array("q")
        self.gc_activity: array[int] = array("q")
        self.gc_row: array[int] = array("q")
        self._ring_row = np.full(self._ring, -1, np.int64)  # row whose events a slot holds
        self._ring_ended = [False] * self._ring  # the row's end event is recorded
        self.t0_ns = _now()

    def _alloc(self, cap: int) -> None:
        self.phase_ns = np.full((cap, _NP, 2), -1, np.int64)
        self._phase_flat = self.phase_ns.reshape(-1)  # a view
        self.gpu_ns = np.full((cap, 2), -1, np.int64)
        self.finished = np.zeros(cap, np.int32)

    def _grow(self) -> None:
        old = self.phase_ns, self.gpu_ns, self.finished
        self._alloc(2 * len(old[0]))
        n = len(old[0])
        self.phase_ns[:n], self.gpu_ns[:n], self.finished[:n] = old

    # ---- run boundaries ----------------------------------------------------------------------
    def start(self) -> int:
        """Reset, and take the run's zero; on CUDA also the base event for GPU times."""
        self.reset()
        if self.cuda:
            torch.cuda.synchronize()
            t_a = _now()
            self._base.record()
            self._base.synchronize()
            self._base_ns = (t_a + _now()) // 2
        self.t0_ns = _now()
        return self.t0_ns

    def finish(self) -> StepTrace:
        """Read every outstanding GPU event (synchronizes the device) and freeze the record.
        After an engine error it still returns what could be read."""
        if self.cuda:
            with contextlib.suppress(RuntimeError):  # a failed device: keep what is readable
                torch.cuda.synchronize()
            for k in range(self._ring):
                self._harvest(k)
        n = self.num_steps

        def col(a: array[int]) -> np.ndarray:
            return np.array(a, np.int64)  # a copy: a view would pin the array's size

        def pairs(a: array[int]) -> np.ndarray:
            return col(a).reshape(-1, 2)

        return StepTrace(
            t0_ns=self.t0_ns,
            phase_ns=self.phase_ns[:n].copy(),
            gpu_ns=self.gpu_ns[:n].copy(),
            shapes=list(self.shapes),
            finished=self.finished[:n].copy(),
            sync_ns=pairs(self.sync_ns),
            sync_row=col(self.sync_row),
            gc_ns=pairs(self.gc_ns),
            gc_generation=col(self.gc_generation),
            gc_activity=col(self.gc_activity),
            gc_row=col(self.gc_row),
        )

    # ---- CPU phases --------------------------------------------------------------------------
    def begin(self, phase: str) -> None:
        self.activity = ACTIVITY[phase]
        self._t0 = _now()

    def end(self, row: int) -> None:
        """Close the phase opened by `begin` and store it in `row`."""
        i = 2 * (row * _NP + self.activity)  # flat index into phase_ns: two scalar stores
        flat = self._phase_flat
        flat[i] = self._t0
        flat[i + 1] = _now()
        self.activity = -1

    def cancel(self) -> None:
        """Drop the open phase (a schedule that found nothing to run is not a step)."""
        self.activity = -1

    def new_row(self, shape: BatchShape) -> int:
        row = self.num_steps
        if row == len(self.gpu_ns):
            self._grow()
        self.shapes.append(shape)
        self.num_steps = row + 1
        return row

    def sync_begin(self) -> int:
        self.activity = _SYNC
        return _now()

    def sync_end(self, row: int, t0: int) -> None:
        self.sync_ns.append(t0)
        self.sync_ns.append(_now())
        self.sync_row.append(row)
        self.activity = -1

    # ---- GPU intervals -----------------------------------------------------------------------
    def gpu_begin(self, row: int) -> None:
        """Call on the host right before the step's first GPU work is enqueued."""
        if not self.cuda:
            self.gpu_ns[row, 0] = _now()
            return
        k = row % self._ring
        if self._ring_row[k] >= 0:
            self._harvest(k)  # recorded `ring` steps ago: long done
        self._ring_row[k] = row
        self._ring_ended[k] = False
        self._ev[k][0].record()

    def gpu_end(self, row: int) -> None:
        """Call right after the step's last GPU work on the compute stream is enqueued."""
        if not self.cuda:
            self.gpu_ns[row, 1] = _now()
            return
        k = row % self._ring
        self._ev[k][1].record()
        self._ring_ended[k] = True

    def _harvest(self, k: int) -> None:
        """Read ring slot k's events into its row. A step cut short (an error between its two
        marks) or events that cannot be read (a failed device) leave the row at -1."""
        row = int(self._ring_row[k])
        if row < 0:
            return
        self._ring_row[k] = -1
        if not self._ring_ended[k]:
            return
        start, end = self._ev[k]
        try:
            t0 = self._base.elapsed_time(start)
            t1 = self._base.elapsed_time(end)
        except RuntimeError:
            return
        self.gpu_ns[row, 0] = self._base_ns + int(t0 * 1e6)
        self.gpu_ns[row, 1] = self._base_ns + int(t1 * 1e6)

    # ---- GC pauses ---------------------------------------------------------------------------
    def install_gc(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def remove_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = _now()
            return
        self.gc_ns.append(self._gc_t0)
        self.gc_ns.append(_now())
        self.gc_generation.append(info["generation"])
        self.gc_activity.append(self.activity)
        self.gc_row.append(self.num_steps - 1)


__all__ = ["ACTIVITY", "PHASE", "StepHooks", "StepTrace"]
