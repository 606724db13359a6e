"""Time one engine step with its launch hidden behind a GPU spin (`replay shapes`,
`replay idlegap`, the segment reference of `replay run`).

CUDA: the stream is idle, a spin kernel (torch.cuda._sleep) long enough to outlast the host's
issue of the step is enqueued, then the whole step; the step's marks fire only once the spin
ends, so the marked interval is its kernels back to back. A sample is clean when, at the end
mark, the start mark has not yet fired (the host was ahead); one that is not is retried with a
longer spin. CPU: the host time between the marks of a synchronous step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replay.analysis.shapes_file import Sample

SPIN_MARGIN = 1.5  # spin = margin x the issue it must outlast (spin_size) + pad
SPIN_PAD_MS = 0.5
SPIN_TRIES = 3  # a sample that is not clean is retried with twice the spin, this many times
ISSUE_HISTORY = 8  # issue times remembered per path (eager / graph)
SPIN_CAL_CYCLES = 10_000_000


@dataclass
class Timer:
    """CUDA: a spin, then the step, its marks on the sweep's events, the clean check at the end
    mark; CPU: the host time between the marks of a synchronous step."""

    cuda: bool
    cycles_per_ms: float = 0.0
    issue: dict[str, list[float]] = field(default_factory=dict)
    spin_s: float = 0.0  # GPU time spent spinning (sweep cost accounting)
    shape_issue_ms: float | None = None  # the primed shape's own untimed issue (spin_size)

    @staticmethod
    def create(cuda: bool) -> Timer:
        t = Timer(cuda)
        if cuda:
            t.cycles_per_ms = t._calibrate()
        return t

    def _calibrate(self) -> float:
        """Spin cycles per ms on this GPU (median of 3)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # first launch of the kernel: loads it
        rates = []
        for _ in range(3):
            torch.cuda.synchronize()
            start.record()
            torch.cuda._sleep(SPIN_CAL_CYCLES)
            end.record()
            end.synchronize()
            rates.append(SPIN_CAL_CYCLES / start.elapsed_time(end))
        return float(np.median(rates))

    def issue_estimate(self, path: str) -> float | None:
        h = self.issue.get(path)
        return max(h) if h else None

    def note_issue(self, path: str, issue_ms: float) -> None:
        h = self.issue.setdefault(path, [])
        h.append(issue_ms)
        del h[:-ISSUE_HISTORY]

    def launch(self, step: Any, marks: Any) -> float:
        """One untimed launch of `step` (replay.gpu.shapes_step.Staged); returns its issue time."""
        step.before()
        t0 = time.perf_counter_ns()
        step.launch()
        issue_ms = (marks.end_ns - t0) / 1e6
        _sync(self.cuda)
        step.after()
        return issue_ms

    def prime(self, step: Any, marks: Any, path: str) -> None:
        """One untimed launch of a new shape (compiles, cuBLAS loads, held rows' blocks reach
        the device; its issue time caps the shape's first spin, `spin_size`) and, on CUDA, a
        second that seeds the spin's size for the first shape of `path` (graph / eager)."""
        self.shape_issue_ms = self.launch(step, marks)
        if self.cuda and self.issue_estimate(path) is None:
            self.shape_issue_ms = self.launch(step, marks)
            self.note_issue(path, self.shape_issue_ms)

    def sample(self, step: Any, marks: Any, path: str) -> tuple[Sample | None, int]:
        """One clean sample of `step` (or None after SPIN_TRIES + 1 unclean ones) and the number
        of unclean tries."""
        if not self.cuda:
            issue_ms = self.launch(step, marks)
            return Sample(marks.gpu_ms(), issue_ms, 0.0), 0
        est = self.issue_estimate(path)
        assert est is not None, "seed the issue estimate first (note_issue)"
        spin_ms = spin_size(est, self.shape_issue_ms)
        unclean = 0
        for _ in range(SPIN_TRIES + 1):
            step.before()
            torch.cuda.synchronize()  # the stream is idle: the spin starts now
            torch.cuda._sleep(int(spin_ms * self.cycles_per_ms))
            t0 = time.perf_counter_ns()
            step.launch()
            issue_ms = (marks.end_ns - t0) / 1e6
            early = marks.early  # asked at the end mark
            torch.cuda.synchronize()
            step.after()
            self.spin_s += spin_ms / 1e3
            self.note_issue(path, issue_ms)
            if not early:
                return Sample(marks.gpu_ms(), issue_ms, spin_ms), unclean
            unclean += 1
            spin_ms = 2 * max(spin_ms, SPIN_MARGIN * issue_ms + SPIN_PAD_MS)
        return None, unclean


def spin_size(recent_max_ms: float, shape_ms: float | None) -> float:
    """The first try's spin: SPIN_MARGIN x the issue time it must outlast + SPIN_PAD_MS. That
    issue is the largest of the path's recent ones, capped by the primed shape's own untimed
    issue: one long issue (a large shape before, a collection, rank 0's seconds-long eager
    launch of a large tensor-parallel mixed step) no longer makes the next shapes' samples spin
    that long. A cap that proves short (the untimed launch paid a compile the samples do not)
    costs one retry, sized on the issue it measured."""
    est = recent_max_ms if shape_ms is None else min(recent_max_ms, shape_ms)
    return SPIN_MARGIN * est + SPIN_PAD_MS


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
