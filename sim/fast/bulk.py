"""A segment's launch times (sim.clock.StepClock.launch, W floats per step, one flat buffer)
as the recorder takes them in bulk."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from core import phases as P
from sim.clock import LAUNCH_TIMES, Times

_I = {name: i for i, name in enumerate(LAUNCH_TIMES)}
W = len(LAUNCH_TIMES)  # a segment keeps launch k's times at [k * W, (k + 1) * W)


def floats() -> array[float]:
    return array("d")


def launch_times(flat: array[float], k: int) -> Times:
    """Launch k's times, from a segment's flat buffer."""
    return tuple(flat[k * W : (k + 1) * W])  # type: ignore[return-value]


def column(t: np.ndarray, i: int) -> array[float]:
    """Column i of a float64 matrix, as the recorder takes it."""
    return array("d", np.ascontiguousarray(t[:, i]).tobytes())


def launch_phases(t: np.ndarray) -> dict[str, tuple[Sequence[float], Sequence[float]]]:
    """(starts, ends) of each CPU phase but process_outputs, from the (steps, W) times."""
    cols = {name: column(t, i) for name, i in _I.items()}
    return {
        P.SCHEDULE: (cols["schedule0"], cols["schedule1"]),
        P.PREPARE_INPUTS: (cols["prepare0"], cols["prepare1"]),
        P.LAUNCH: (cols["prepare1"], cols["launch1"]),
        P.SAMPLE: (cols["launch1"], cols["sample1"]),
        P.DRAFT: (cols["draft0"], cols["draft1"]),
    }
