"""A segment's step times (sim.clock.StepClock.step, one tuple per step) as the recorder
takes them in bulk."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain

import numpy as np

from core import phases as P
from sim.clock import TIMES, Times

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
