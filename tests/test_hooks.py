"""The step hooks' record (engine.hooks) and the replay's account of their cost
(replay.gpu.measure). No simpy/polars: this file also runs on the GPU host."""

from __future__ import annotations

import gc

import numpy as np
import pytest


def test_step_hooks_grow_and_freeze_the_record():
    import torch

    from bubblesim.core import phases as P
    from bubblesim.core.shape import BatchShape
    from engine.hooks import StepHooks
    from replay.gpu.measure import step_hook_calls

    h = StepHooks(torch.device("cpu"), capacity=2)
    t0 = h.start()
    shape = BatchShape(num_reqs=1, decode_tokens=1)
    for _ in range(5):  # past two doublings
        step_hook_calls(h, shape)
    h.begin(P.SCHEDULE)
    h.cancel()
    h.on_gc("start", {})
    h.on_gc("stop", {"generation": 2})
    tr = h.finish()
    assert tr.num_steps == 5 and tr.phase_ns.shape == (5, len(P.CPU_PHASES), 2)
    assert tr.phase_ns.dtype == np.int64 and (tr.phase_ns >= t0).all()
    assert (tr.phase_ns[:, :, 1] >= tr.phase_ns[:, :, 0]).all()
    starts = tr.phase_ns[:, P.CPU_PHASES.index(P.SCHEDULE), 0]
    assert (np.diff(starts) > 0).all()
    assert (tr.gpu_ns[:, 1] >= tr.gpu_ns[:, 0]).all() and (tr.gpu_ns >= t0).all()
    assert tr.finished.dtype == np.int32 and tr.finished.tolist() == [1] * 5
    assert tr.sync_ns.shape == (5, 2) and tr.sync_row.tolist() == [0, 1, 2, 3, 4]
    assert tr.gc_generation.tolist() == [2] and tr.gc_row.tolist() == [4]
    assert tr.gc_activity.tolist() == [-1]
    gc.collect()


def test_overhead_fraction_counts_the_stepping_time_only():
    from replay.gpu.measure import overhead_summary

    cost = {"per_step_us": 10.0, "gc_callback_us": 1.0}
    s = overhead_summary(cost, {"num_steps": 1000, "span_s": 3.0, "idle_s": 1.0, "gc": {}})
    assert s["mean_step_us"] == pytest.approx(2000.0)  # (3 s - 1 s idle) / 1000 steps
    assert s["overhead_fraction"] == pytest.approx(10.0 / 2000.0)
