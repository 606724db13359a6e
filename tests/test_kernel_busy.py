"""Measured GPU busy time is kernel time: the hooks' marks around the forward (and the GPU
drafter) let replay take GPU waits for the host out of a step's interval, so a measured and a
predicted run count the same idle time (replay.gpu.measure.kernel_busy)."""

from __future__ import annotations

import numpy as np
import pytest

from bubblesim.core.phases import CPU_PHASES, DRAFT, SAMPLE
from replay.gpu.measure import SegmentReference, kernel_busy

US = 1_000
_S, _D = CPU_PHASES.index(SAMPLE), CPU_PHASES.index(DRAFT)


def _steps(rows: list[dict]) -> tuple[np.ndarray, ...]:
    n = len(rows)
    raw = np.array([[r["s"], r["e"]] for r in rows], np.int64)
    marks = np.full((n, 3), -1, np.int64)
    host = np.full((n, 3), -1, np.int64)
    ph = np.full((n, len(CPU_PHASES), 2), -1, np.int64)
    for i, r in enumerate(rows):
        marks[i, :2] = r["f0"], r["f1"]
        host[i, :2] = r["hf0"], r["hf1"]
        ph[i, _S] = (r["hf1"], r["h_end"])
        if "d0" in r:
            marks[i, 2], host[i, 2] = r["d0"], r["hd0"]
            ph[i, _D] = (r["hd0"] - 5 * US, r["h_end"])
    return raw, marks, host, ph


def test_clean_steps_keep_their_interval_and_waits_are_cut() -> None:
    # step 0 and 1: the host enqueued everything long before the GPU got there (clean):
    # lead (input copies) 30 us, forward 1000 us, tail 10 us
    clean = [
        dict(s=t, f0=t + 30 * US, f1=t + 1030 * US, e=t + 1040 * US,
             hf0=t - 500 * US, hf1=t - 450 * US, h_end=t - 400 * US)
        for t in (10_000 * US, 20_000 * US)
    ]  # fmt: skip
    # step 2: the GPU reached the start event, then waited 300 us for the host to launch the
    # graph (lead 330 us), and 200 us after the graph for the host's token copy (tail 210 us)
    t = 30_000 * US
    late = dict(s=t, f0=t + 330 * US, f1=t + 1330 * US, e=t + 1540 * US,
                hf0=t + 320 * US, hf1=t + 330 * US, h_end=t + 1530 * US)  # fmt: skip
    raw, marks, host, ph = _steps([*clean, late])
    out, acc = kernel_busy(raw, raw.copy(), marks, host, ph, np.ones(3, bool))
    assert (out[:2] == raw[:2]).all()  # clean steps unchanged
    assert out[2, 0] == t + 300 * US  # start moved past the 300 us wait: copies stay 30 us
    assert out[2, 1] == t + 1540 * US - 200 * US  # the tail's 200 us wait taken off the end
    busy = out[2, 1] - out[2, 0]
    assert busy == 30 * US + 1000 * US + 10 * US  # the clean steps' kernel time
    assert acc["lead"]["clean"] == 2 and acc["lead"]["kernel_us"]["graph"] == 30
    assert acc["removed_s"] == (300 + 200) * 1e-6


def test_a_gpu_drafter_waiting_for_the_draft_phase_is_idle_not_busy() -> None:
    t0, t1 = 10_000 * US, 20_000 * US
    # clean: draft segment (rejection sampling -> drafter start) 20 us, drafter 50 us
    a = dict(
        s=t0,
        f0=t0 + 30 * US,
        f1=t0 + 1030 * US,
        d0=t0 + 1050 * US,
        e=t0 + 1100 * US,
        hf0=t0 - 900 * US,
        hf1=t0 - 850 * US,
        hd0=t0 - 800 * US,
        h_end=t0 - 700 * US,
    )
    # the drafter's kernels were issued 400 us after the verify pass ended
    b = dict(
        s=t1,
        f0=t1 + 30 * US,
        f1=t1 + 1030 * US,
        d0=t1 + 1450 * US,
        e=t1 + 1500 * US,
        hf0=t1 - 900 * US,
        hf1=t1 - 850 * US,
        hd0=t1 + 1440 * US,
        h_end=t1 + 1495 * US,
    )
    # fmt: skip
    raw, marks, host, ph = _steps([a, b])
    out, acc = kernel_busy(raw, raw.copy(), marks, host, ph, np.ones(2, bool))
    assert (out[0] == raw[0]).all()
    assert out[1, 1] - out[1, 0] == out[0, 1] - out[0, 0]  # same kernels, same busy time
    assert acc["tail"]["wait_s"] == 400e-6
    # every step's span is reported, clean or not: tail 20 and 420 us, drafter 50 us
    assert acc["tail"]["span_us"]["p10"] == 20 + 0.1 * 400
    assert acc["draft"]["span_us"] == {"p10": 50.0, "p50": 50.0, "p90": 50.0}


def test_no_clean_reference_means_no_estimate_and_nothing_cut() -> None:
    t = 10_000 * US
    late = dict(s=t, f0=t + 330 * US, f1=t + 1330 * US, e=t + 1540 * US,
                hf0=t + 320 * US, hf1=t + 330 * US, h_end=t + 1530 * US)  # fmt: skip
    raw, marks, host, ph = _steps([late])
    out, acc = kernel_busy(raw, raw.copy(), marks, host, ph, np.ones(1, bool))
    assert (out == raw).all() and acc["lead"]["kernel_us"] == {}


def _drafter_behind_host(t: int, drafter_us: int) -> dict:
    """A step whose drafter kernels trail the host's launches: the draft segment is never
    clean (the drafter starts 20 us after its host mark, the host's phase ends 10 us before
    the GPU's end), and it spans `drafter_us`."""
    return dict(s=t, f0=t + 30 * US, f1=t + 1030 * US, d0=t + 1050 * US,
                e=t + 1050 * US + drafter_us * US, hf0=t - 900 * US, hf1=t - 850 * US,
                hd0=t + 1030 * US, h_end=t + 1040 * US + drafter_us * US)  # fmt: skip


def test_a_segment_never_clean_in_the_run_takes_the_reference() -> None:
    # two steps at 4 and 12 requests, contexts 1000 and 3000; drafter spans 700 and 900 us
    a, b = _drafter_behind_host(10_000 * US, 700), _drafter_behind_host(20_000 * US, 900)
    raw, marks, host, ph = _steps([a, b])
    graphed = np.ones(2, bool)
    out, acc = kernel_busy(raw, raw.copy(), marks, host, ph, graphed)
    assert acc["draft"]["clean"] == 0 and (out == raw).all()  # no estimate: nothing cut
    # the drafter's kernel time measured apart: 100 us at 1 request, 300 at 16 (ctx 1000),
    # twice that at ctx 5000
    ref = SegmentReference(
        (1, 16), (1000, 5000), {"draft": np.array([[100e3, 200e3], [300e3, 600e3]])}
    )
    rows, ctx = np.array([4.0, 12.0]), np.array([1000.0, 3000.0])
    out, acc = kernel_busy(raw, raw.copy(), marks, host, ph, graphed, ref, rows, ctx)
    kern = ref.at("draft", rows, ctx)
    # rows 4: 100 + 3/15 * 200; rows 12: halfway between 246.7 (ctx 1000) and 493.3 (5000)
    assert kern.tolist() == pytest.approx([140e3, 370e3])
    assert acc["draft"]["kernel_source"] == {"graph": "reference"}
    ends = raw[:, 1] - (np.array([700e3, 900e3]) - kern).astype(np.int64)
    assert out[:, 1].tolist() == ends.tolist() and (out[:, 0] == raw[:, 0]).all()
    assert acc["reference"]["rows"] == [1, 16]
    # a run with its own clean drafter segments keeps them: the reference is not read
    clean = dict(_drafter_behind_host(30_000 * US, 150), hd0=29_000 * US, h_end=29_100 * US)
    raw, marks, host, ph = _steps([a, b, clean])
    rows3, ctx3 = np.array([4.0, 12.0, 4.0]), np.array([1000.0, 3000.0, 1000.0])
    out, acc = kernel_busy(raw, raw.copy(), marks, host, ph, np.ones(3, bool), ref, rows3, ctx3)
    assert acc["draft"]["kernel_source"] == {"graph": "run", "eager": "run"}
    assert acc["draft"]["wait_s"] == pytest.approx((700 - 150 + 900 - 150) * 1e-6)


def test_reference_interpolates_linearly_and_clamps_at_the_edges() -> None:
    ref = SegmentReference((2, 8), (100,), {"lead": np.array([[20e3], [50e3]])})
    got = ref.at("lead", np.array([1.0, 2.0, 4.0, 8.0, 64.0]), np.array([10.0] * 5))
    assert got.tolist() == [20e3, 20e3, 30e3, 50e3, 50e3]


def test_cpu_engine_records_forward_marks_inside_each_step() -> None:
    from bubblesim.core.config import load_config
    from bubblesim.core.trace import make_trace
    from engine.engine import Engine

    cfg = load_config(None, ["model=tiny", "device=cpu", "max_num_seqs=4"])
    eng = Engine(cfg)
    n = 3
    tr = make_trace(np.zeros(n), np.full(n, 12), np.full(n, 5))
    eng.run(tr, arrival="asap")
    st = eng.trace
    assert st.mark_ns.shape == (st.num_steps, 3)
    g, m = st.gpu_ns, st.mark_ns
    assert (g[:, 0] <= m[:, 0]).all() and (m[:, 0] <= m[:, 1]).all() and (m[:, 1] <= g[:, 1]).all()
    assert (m[:, 2] == -1).all()  # no drafter
    assert (st.graphed == 0).all()  # no CUDA graphs on CPU
