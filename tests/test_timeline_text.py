"""timeline.json's text is formatted event by event (bubblesim.core.runfmt.timeline): it must be
what `json.dumps(trace, separators=(",", ":"), allow_nan=False)` writes, with every time
`round(t * 1e6, 3)` as Python rounds it."""

from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblesim.core.runfmt import RunRecorder
from bubblesim.core.runfmt.bubbles import account_bubbles
from bubblesim.core.runfmt.timeline import build_timeline, us_values
from bubblesim.core.shape import BatchShape


def _same(xs: np.ndarray) -> None:
    want = [round(float(x) * 1e6, 3) for x in xs]
    got = us_values(xs)
    assert [repr(v) for v in got] == [repr(v) for v in want]


def test_us_values_rounds_as_python() -> None:
    rng = np.random.default_rng(0)
    spread = np.concatenate(
        (
            rng.uniform(0, 1e5, 20_000),  # a day in seconds
            rng.uniform(-1e-3, 1e-3, 5_000),  # durations near zero, both signs
            np.array([0.0, -0.0, 1e-12, 5e-10, -5e-10, 1.5e-9, 2.5e-9, 86_400.0, 9e9]),
        )
    )
    _same(spread)
    # values whose microseconds sit on a half nanosecond: where rounding the product may flip
    halves = (rng.integers(0, 10**12, 20_000) + 0.5) / 1e9
    _same(halves)
    _same(np.nextafter(halves, 0))
    _same(np.nextafter(halves, 1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(-1e7, 1e7, allow_nan=False), min_size=1, max_size=50))
def test_us_values_any_float(xs: list[float]) -> None:
    _same(np.array(xs))


def test_us_values_keeps_nan_and_inf() -> None:
    got = us_values(np.array([math.nan, math.inf, -math.inf]))
    assert math.isnan(got[0]) and got[1:] == [math.inf, -math.inf]


def _recording() -> RunRecorder:
    r = RunRecorder()
    a, b = r.add_request("a", 0.0), r.add_request(7, 0.25)
    for i in range(30):
        s = r.add_step(BatchShape(num_reqs=2, num_prefill_reqs=int(i == 0), decode_tokens=2))
        t = 0.1 * i + 1 / 3
        r.phase(s, "schedule", t, t + 1e-4 / 3)
        r.phase(s, "launch", t + 2e-4, t + 3e-4)
        r.sync(s, t + 4e-4, t + 0.05)
        r.gpu(s, t + 3e-4, t + 0.07 + 1e-7 * i)
        r.tokens(a, t + 0.07)
        r.tokens(b, t + 0.07, n=2, accepted_draft=1)
        if i % 7 == 3:
            r.gc_pause(t + 0.08, 0.003, i % 3, "process_outputs")
    r.finish(a, 3.5)
    return r


def test_text_is_json_dumps_of_itself() -> None:
    rec = _recording().freeze()
    bub = account_bubbles(rec)
    for max_steps, from_s in ((None, 0.0), (10, 0.0), (5, 1.05)):
        tl = build_timeline(rec, bub, "sim", max_steps, from_s)
        trace = json.loads(tl.text)
        assert json.dumps(trace, separators=(",", ":"), allow_nan=False) == tl.text
        assert trace["otherData"] == tl.other
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert {e["cat"] for e in spans} == {"cpu", "sync", "gc", "gpu", "bubble"}
        gpu = [e for e in spans if e["cat"] == "gpu"]
        steps = [e["args"]["step"] for e in gpu]
        first = tl.other["first_step"]
        assert steps[0] == first
        for e in gpu:
            i = e["args"]["step"]
            assert e["ts"] == round(rec.gpu_start[i] * 1e6, 3)
            assert e["dur"] == round((rec.gpu_end[i] - rec.gpu_start[i]) * 1e6, 3)
            assert e["name"] == ("prefill" if i == 0 else "decode")
            assert e["args"]["num_reqs"] == 2 and e["args"]["decode_tokens"] == 2
        gc = [e for e in spans if e["cat"] == "gc"]
        assert all(e["args"]["phase"] == "process_outputs" for e in gc)
