"""Run one simulation with the fast-forward off and on, and compare the two records field by
field (the fast-forwards must reproduce the step loop to the bit). Shared by the tests."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.runfmt import RunRecorder
from bubblesim.core.trace import make_trace, write_trace
from sim.loop import SimLoop


def small_trace(tmp: Path, n: int = 60, span_s: float = 2.0, seed: int = 0) -> Path:
    """n requests arriving uniformly over span_s (prompts 20-599, outputs 1-199), written to
    tmp as t<n>-<seed>.parquet."""
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0, span_s, n))
    t = make_trace(arrival, rng.integers(20, 600, n), rng.integers(1, 200, n))
    return write_trace(t, tmp / f"t{n}-{seed}.parquet")


def records_without_and_with_fast_forward(
    sets: list[str], trace: Path, make_loop: Callable[..., SimLoop] = SimLoop
) -> tuple[RunRecorder, RunRecorder]:
    """The frozen records of `sim run trace --set ...` with fast_forward False, then True
    (`make_loop`: what builds the SimLoop, e.g. a wrapper that keeps it for inspection)."""
    recs = []
    for ff in (False, True):
        orig = simrun.SimLoop
        simrun.SimLoop = functools.partial(make_loop, fast_forward=ff)  # type: ignore[misc]
        try:
            recs.append(simrun.simulate(load_config(None, sets), trace).recorder.freeze())
        finally:
            simrun.SimLoop = orig  # type: ignore[misc]
    return recs[0], recs[1]


def records_and_loops(
    sets: list[str], trace: Path
) -> tuple[RunRecorder, RunRecorder, list[SimLoop]]:
    """records_without_and_with_fast_forward, and the two runs' SimLoops (for inspection)."""
    loops: list[SimLoop] = []

    def keep(*args: object, **kw: object) -> SimLoop:
        loops.append(SimLoop(*args, **kw))  # type: ignore[arg-type]
        return loops[-1]

    a, b = records_without_and_with_fast_forward(sets, trace, keep)
    return a, b, loops


def assert_same_records(a: RunRecorder, b: RunRecorder, label: str) -> None:
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=f"{name} {label}")
        else:
            assert x == y, f"{name} {label}"
