"""The segment reference (replay.gpu.segref): a step segment's kernel time timed on the run's
engine after the run, for runs where that segment never ran clean (replay.gpu.measure.
kernel_busy). On CPU with the tiny model: the engine's own launch path sets every mark, each
segment of each grid point is timed, and the engine is left as a run leaves it."""

from __future__ import annotations

import helpers
import numpy as np
import pytest

from engine.engine import Engine
from engine.requests import RequestInput
from replay.gpu import segref
from replay.gpu.run import segment_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def test_grid_points_span_the_steps_it_serves() -> None:
    rows = np.array([1, 1, 2, 3, 5, 8, 13, 40])
    ctx = np.array([100, 200, 300, 400, 500, 600, 700, 4000])
    r, c = segref.grid_points(rows, ctx)
    assert r[0] == 1 and r[-1] == 40 and list(r) == sorted(set(r))
    assert len(c) == 2 and 100 < c[0] < c[1] < 4000


@pytest.mark.parametrize("method", ["ngram-gpu", ""])
def test_measure_times_every_segment_at_every_point(method: str) -> None:
    cfg = helpers.spec_cfg(method) if method else helpers.make_cfg()
    eng = Engine(cfg)
    hooks = eng.hooks
    ref = segref.measure(eng, (1, 3), (20, 60), repeats=2)
    want = {"lead", "tail", "draft"} if method else {"lead", "tail"}
    assert set(ref.ns) == want
    for v in ref.ns.values():
        assert v.shape == (2, 2) and (v > 0).all()
    assert eng.hooks is hooks and eng.states == []  # the engine as a run leaves it
    assert ref.describe()["rows"] == [1, 3]
    # and it still runs requests
    out = eng.run([RequestInput("a", 9, 3)])
    assert len(out[0].token_ids) == 3


def test_a_cpu_run_takes_no_reference() -> None:
    eng = Engine(helpers.spec_cfg("ngram-gpu"))
    eng.run([RequestInput("a", 9, 3)])
    assert segment_reference(eng, eng.trace) is None


@pytest.mark.gpu
def test_on_a_gpu_the_reference_is_kernel_time_behind_a_spin() -> None:
    """CUDA: every sample came clean behind the spin, so each span is the kernels' own; a
    step whose host trails the drafter spans more than the reference (the wait kernel_busy
    takes out)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = Engine(helpers.spec_cfg("ngram-gpu", device="cuda"))
    ref = segref.measure(eng, (1, 8), (64, 512))
    assert set(ref.ns) == {"lead", "tail", "draft"}
    for v in ref.ns.values():
        assert (v > 0).all() and (v < 5e6).all()  # positive, under 5 ms each
    # the drafter's window is the batch's longest row: more context, no less time
    assert (ref.ns["draft"][:, 1] >= 0.9 * ref.ns["draft"][:, 0]).all()
