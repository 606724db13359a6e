"""A segment's steps into the recorder in bulk: their shapes, and their times
(sim.clock.StepClock.step, one tuple per step)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain

import numpy as np

from bubblesim.core import phases as P
from bubblesim.core.runfmt import RunRecorder
from sim.clock import GPU_END, GPU_START, PO1, TIMES, Pass, StepClock, Times

_I = {name: i for i, name in enumerate(TIMES)}
_PHASE_TIMES = ("schedule0", "schedule1", "prepare0", "prepare1", "launch1", "sample1", "draft0",
                "draft1")  # fmt: skip


def times_matrix(steps: list[Times]) -> np.ndarray:
    """(len(steps), len(TIMES)) float64."""
    w = len(TIMES)
    return np.fromiter(chain.from_iterable(steps), np.float64, len(steps) * w).reshape(-1, w)


def column(t: np.ndarray, i: int) -> array[float]:
    """Column i of a float64 matrix, as the recorder takes it."""
    return array("d", np.ascontiguousarray(t[:, i]).tobytes())


def launch_phases(t: np.ndarray) -> dict[str, tuple[Sequence[float], Sequence[float]]]:
    """(starts, ends) of each CPU phase but process_outputs, from `times_matrix`."""
    cols = {name: column(t, _I[name]) for name in _PHASE_TIMES}
    return {
        P.SCHEDULE: (cols["schedule0"], cols["schedule1"]),
        P.PREPARE_INPUTS: (cols["prepare0"], cols["prepare1"]),
        P.LAUNCH: (cols["prepare1"], cols["launch1"]),
        P.SAMPLE: (cols["launch1"], cols["sample1"]),
        P.DRAFT: (cols["draft0"], cols["draft1"]),
    }


def record_steps(
    rec: RunRecorder, clock: StepClock, old: list[Pass], shapes: np.ndarray, t: np.ndarray
) -> tuple[int, array[float]]:
    """A segment's steps (iteration k launched step k and completed the oldest pass: the
    len(old) passes in flight at its start, then its own launches in order): their shapes and
    CPU phases, every completed pass's process_outputs and GPU interval, the waits and pauses
    the clock kept; `t`: their times (`times_matrix`). Returns (the first step added,
    process_outputs' end per iteration)."""
    n, nd = len(t), len(old)
    s0 = rec.add_steps(shapes, launch_phases(t))
    po0, po1 = column(t, PO1 - 1), column(t, PO1)
    for k, p in enumerate(old[:n]):
        rec.phase(p.step, P.PROCESS_OUTPUTS, po0[k], po1[k])
        rec.gpu(p.step, p.gpu_start_s, p.gpu_end_s)
    done = n - nd  # launched steps completed in the segment
    if done > 0:
        rec.phases(s0, P.PROCESS_OUTPUTS, po0[nd:n], po1[nd:n])
        rec.gpus(s0, column(t[:done], GPU_START), column(t[:done], GPU_END))
    clock.flush(rec)
    return s0, po1


def last_completed(s0: int, old: list[Pass], n: int) -> int:
    """The last step a segment of n iterations completed (its first step added is s0)."""
    return s0 + n - len(old) - 1 if n > len(old) else old[n - 1].step
