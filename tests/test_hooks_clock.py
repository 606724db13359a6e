"""GPU event times on the host clock: two anchors and the rate between them (engine.hooks).

Measured on an H100 host (2026-11-26): the GPU's timer fell behind the host's perf_counter by
6-25 us a second, so with the start anchor alone a GPU time 45 s into a run landed up to ~1.1 ms
early against the host's phases (a step issued to an idle GPU looked up to that much shorter). The
mapping arithmetic is checked here on CPU with the anchors stubbed; causality on a real GPU is
checked in tests/test_engine_gpu.py."""

from __future__ import annotations

import numpy as np
import torch

from bubblesim.core.shape import BatchShape
from engine.hooks import StepHooks


def _hooks_with_raw_gpu_times(raw: list[tuple[int, int]]) -> StepHooks:
    h = StepHooks(torch.device("cpu"))
    for i, (a, b) in enumerate(raw):
        row = h.new_row(BatchShape())
        h._gpu[2 * row], h._gpu[2 * row + 1] = a, b  # ns since the base, GPU clock
        h._mark[3 * row] = a if i else -1
    return h


def test_gpu_times_are_mapped_with_the_rate_between_the_anchors() -> None:
    base_ns = 5_000_000
    gpu_span_ms = 40_000.0  # the end anchor, 40 s after the base on the GPU's clock
    host_span_ns = 40_000_000_000 + 1_040_000  # the host saw 40 s + 1.04 ms: 26 ppm
    h = _hooks_with_raw_gpu_times([(0, 1_000_000), (20_000_000_000, 20_001_500_000), (-1, -1)])
    h._base_ns, h._base_window_ns = base_ns, 12_000
    h._base = h._base_end = None
    h._anchor = lambda ev: (base_ns + host_span_ns, 30_000)  # type: ignore[method-assign]
    h.elapsed_ms = lambda a, b: gpu_span_ms  # type: ignore[method-assign]
    h._map_gpu_times()
    g = np.frombuffer(h._gpu, np.int64, 6).reshape(3, 2)
    assert g[0, 0] == base_ns
    assert g[1, 0] == base_ns + 20_000_000_000 + 520_000  # half the drift at half the span
    assert g[1, 1] - g[1, 0] == 1_500_039  # an interval scales by the rate too (26 ppm)
    assert (g[2] == -1).all()  # absent stays absent
    assert h._mark[3] == g[1, 0] and h._mark[0] == -1
    assert abs(h.clock["drift_ppm"] - 26.0) < 1e-6
    assert h.clock["anchor_window_us"] == 30.0


def test_a_failed_end_anchor_keeps_one_anchor() -> None:
    h = _hooks_with_raw_gpu_times([(1_000, 2_000)])
    h._base_ns = 7
    h._base = h._base_end = None

    def failed(ev: object) -> tuple[int, int]:
        raise RuntimeError("device lost")

    h._anchor = failed  # type: ignore[method-assign]
    h._map_gpu_times()
    assert h._gpu[0] == 1_007 and h.clock["host_per_gpu_ns"] == 1.0
