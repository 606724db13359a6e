"""The worker ranks' own launch times: what rank 0's hooks cannot see.

With tensor parallelism every rank issues the same step from its own process, and each
all-reduce waits on the device for the last rank to issue it, so an eager step's GPU pass ends
after the slowest rank's launch, not rank 0's. A worker rank records, for each step rank 0
announces while recording is on: the hooks row rank 0 put in the step's header, when the header
reached the worker, and the worker's launch (input finishing, then the forward's issue or graph
replay: rank 0's `launch` phase), all in `time.perf_counter_ns` (CLOCK_MONOTONIC on Linux: one
clock for every process of the host, so they compare with rank 0's hooks directly).

Rank 0 starts the record at `Engine.start` and gathers it at `Engine.finish` (header command
OP_RANK_TIMES, engine.tp.comm); replay writes it beside the run's steps (`ranks.parquet`).
Cost per step: three perf_counter_ns calls and four array appends on the worker, nothing on
rank 0 until the gather.
"""

from __future__ import annotations

from array import array

import numpy as np

COLUMNS = ("rank", "row", "recv_ns", "launch0_ns", "launch1_ns")  # columns of `table()`


class RankTimes:
    """One worker rank's record (module docstring); empty and off until `start`."""

    __slots__ = ("rank", "on", "_cols")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.on = False
        self._cols = tuple(array("q") for _ in COLUMNS[1:])

    def start(self) -> None:
        """Forget what was recorded and record from the next step on."""
        for c in self._cols:
            del c[:]
        self.on = True

    def add(self, row: int, recv_ns: int, launch0_ns: int, launch1_ns: int) -> None:
        row_c, recv_c, l0_c, l1_c = self._cols
        row_c.append(row)
        recv_c.append(recv_ns)
        l0_c.append(launch0_ns)
        l1_c.append(launch1_ns)

    def table(self) -> np.ndarray:
        """int64 [steps, len(COLUMNS)] of what was recorded since `start`; stops recording."""
        self.on = False
        n = len(self._cols[0])
        out = np.empty((n, len(COLUMNS)), np.int64)
        out[:, 0] = self.rank
        for j, c in enumerate(self._cols, start=1):
            out[:, j] = np.frombuffer(c, np.int64, n) if n else 0
        return out


def empty_table() -> np.ndarray:
    return np.zeros((0, len(COLUMNS)), np.int64)
