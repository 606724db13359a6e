"""Turn what the engine's hooks recorded (`engine.hooks.StepTrace`) and its per-request outputs
(`engine.requests.RequestOutput`) into a `RunRecorder`, in exactly the form the simulator fills:

- one clock: seconds since the run's zero (`StepTrace.t0_ns`, perf_counter_ns);
- steps in launch order (hooks row == recorder step), each with its `BatchShape`, its CPU
  phases, its GPU interval (CUDA events on the compute stream, put on the host clock by the
  hooks' base event; its start no earlier than the launch phase, see `_kernel_intervals`),
  narrowed to the step's kernel time where the hooks' marks show the GPU waiting for the host
  inside it (`kernel_busy`): the simulator's GPU pass is kernels only, so both sides count the
  same idle time as bubbles,
  the sync waits and GC pauses (gc.callbacks) as recorded;
- token emission at the END of the `process_outputs` phase of the step whose results carry it,
  the sim's convention: the engine stamps a token when it applies it, inside that phase, so
  each stamp is moved to the end of the phase interval that contains it; n tokens of one
  request in one step are 1 sampled + n - 1 accepted drafts (per request and per step);
- request arrival = the engine's arrival stamp (realtime: the trace's arrival time, asap: when
  it was queued).
Also: the instrumentation's own cost (`hook_overhead`), measured on a spare `StepHooks`.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bubblesim.core import phases as P
from bubblesim.core.phases import ALL_CPU_ACTIVITIES, CPU_PHASES, LAUNCH, PROCESS_OUTPUTS
from bubblesim.core.runfmt import RunRecorder
from bubblesim.core.shape import BatchShape
from engine.hooks import StepHooks

_PO = CPU_PHASES.index(PROCESS_OUTPUTS)
_LAUNCH = CPU_PHASES.index(LAUNCH)


@dataclass
class Converted:
    recorder: RunRecorder
    dropped_gpu_rows: int  # GPU intervals left out: never completed (an interrupted step)
    unfinished: int  # requests that had arrived but not finished
    gpu_start_moved_ns: np.ndarray  # per step: how far the GPU start was moved to the launch
    waits: dict[str, Any] | None = None  # kernel_busy's account of GPU waits inside intervals


def _kernel_intervals(gpu_ns: np.ndarray, launch_start_ns: np.ndarray) -> tuple[np.ndarray, ...]:
    """The hooks' GPU start event is recorded before the step's input copies, at the start of
    prepare_inputs: on an idle GPU it fires then, and the interval would hold the CPU's whole
    prepare phase. No kernel of the step can start before its launch phase begins, so the
    start is moved to max(event, launch start) (clamped to the end); the input copies' few
    microseconds are the price. Returns the intervals and how far each start moved."""
    g = gpu_ns.copy()
    has = (g[:, 0] >= 0) & (launch_start_ns >= 0)
    start = np.where(has, np.maximum(g[:, 0], launch_start_ns), g[:, 0])
    start = np.where(has & (g[:, 1] >= 0), np.minimum(start, g[:, 1]), start)
    moved = np.where(has, start - g[:, 0], 0)
    g[:, 0] = start
    return g, moved


def to_recorder(
    trace: Any, outputs: Sequence[Any], reference: SegmentReference | None = None
) -> Converted:
    """`trace`: engine.hooks.StepTrace; `outputs`: RequestOutput of every request that reached
    the engine during the run, in arrival order (recorder rows follow it); `reference`: kernel
    times for segments that never ran clean in the run (`kernel_busy`)."""
    t0 = trace.t0_ns
    rec = RunRecorder()
    n = trace.num_steps
    for shape in trace.shapes:
        rec.add_step(shape)
    ph = trace.phase_ns
    for j, name in enumerate(CPU_PHASES):
        for row in np.flatnonzero((ph[:n, j, 0] >= 0) & (ph[:n, j, 1] >= ph[:n, j, 0])).tolist():
            rec.phase(row, name, (ph[row, j, 0] - t0) / 1e9, (ph[row, j, 1] - t0) / 1e9)
    g, moved_ns = _kernel_intervals(trace.gpu_ns[:n], ph[:n, _LAUNCH, 0])
    waits = None
    marks = getattr(trace, "mark_ns", None)
    if marks is not None and len(marks) == n and n:
        rows = ctx = None
        if reference is not None:  # what the reference is read at, per step
            rows = np.array([sh.num_reqs for sh in trace.shapes[:n]], np.float64)
            ctx = np.array([sh.max_kv_tokens for sh in trace.shapes[:n]], np.float64)
        g, waits = kernel_busy(
            trace.gpu_ns[:n], g, marks, trace.mark_host_ns, ph[:n], trace.graphed[:n],
            reference, rows, ctx,
        )  # fmt: skip
    ok = (g[:, 0] >= 0) & (g[:, 1] >= g[:, 0])
    for row in np.flatnonzero(ok).tolist():
        rec.gpu(row, (g[row, 0] - t0) / 1e9, (g[row, 1] - t0) / 1e9)
    for (s, e), row in zip(trace.sync_ns.tolist(), trace.sync_row.tolist()):
        if 0 <= row < n and e >= s:
            rec.sync(row, (s - t0) / 1e9, (e - t0) / 1e9)
    for (s, e), gen, act, row in zip(
        trace.gc_ns.tolist(),
        trace.gc_generation.tolist(),
        trace.gc_activity.tolist(),
        trace.gc_row.tolist(),
    ):
        phase = ALL_CPU_ACTIVITIES[act] if 0 <= act < len(ALL_CPU_ACTIVITIES) else ""
        rec.gc_pause((s - t0) / 1e9, (e - s) / 1e9, gen, phase, row if row < n else n - 1)
    emit = _EmissionClock(ph[:n, _PO], t0)
    unfinished = 0
    for out in outputs:
        r = rec.add_request(out.request_id, (out.arrival_ns - t0) / 1e9)
        times, rows = emit.at(out.token_ns)
        for (t_s, row), count in _runs(list(zip(times, rows))):
            # n tokens in one step = 1 sampled + n - 1 accepted drafts (speculative decoding)
            rec.tokens(r, t_s, count, count - 1)
            if count > 1 and row >= 0:
                rec.accepted(row, count - 1)
        for _ in range(out.num_preemptions):
            rec.preempt(r)
        if out.finish_ns >= 0:
            rec.finish(r, emit.at([out.finish_ns])[0][0])
        else:
            unfinished += 1
    return Converted(rec, int(n - ok.sum()), unfinished, moved_ns, waits)


# ---- GPU waits for the host inside a step's interval --------------------------------------------
CLEAN_MARGIN_NS = 20_000  # > the base event's host/GPU clock alignment error (~5-15 us)
_SAMPLE = CPU_PHASES.index(P.SAMPLE)
_DRAFT = CPU_PHASES.index(P.DRAFT)
SEGMENTS = ("lead", "tail", "draft")


@dataclass(frozen=True)
class SegmentReference:
    """Kernel time of each step segment measured outside the run, behind a GPU spin
    (replay.gpu.segref): `ns[name]` [len(rows), len(ctx)] at `rows` requests (ascending) and
    `ctx` tokens of the longest context (ascending). Used for a segment with no clean step in
    the run (a host that never gets ahead of the GPU drafter, seed 5 on llama3.2-1b)."""

    rows: tuple[int, ...]
    ctx: tuple[int, ...]
    ns: dict[str, np.ndarray]

    def at(self, name: str, rows: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """Linear in rows, then in context, clamped at the grid's edges."""
        t = self.ns[name]
        r = np.asarray(self.rows, np.float64)
        by_ctx = np.stack([np.interp(rows, r, t[:, j]) for j in range(t.shape[1])], axis=1)
        if len(self.ctx) == 1:
            return by_ctx[:, 0]
        c = np.asarray(self.ctx, np.float64)
        x = np.clip(ctx, c[0], c[-1])
        j = np.clip(np.searchsorted(c, x, side="right") - 1, 0, len(c) - 2)
        w = (x - c[j]) / (c[j + 1] - c[j])
        i = np.arange(len(rows))
        return by_ctx[i, j] * (1 - w) + by_ctx[i, j + 1] * w

    def describe(self) -> dict[str, Any]:
        return {
            "rows": list(self.rows),
            "ctx": list(self.ctx),
            "kernel_us": {k: (v / 1e3).round(1).tolist() for k, v in self.ns.items()},
        }


# a reference applies to graph steps; the drafter's kernels (eager torch ops after the
# forward) are the same on an eager step, so "draft" applies to both
_REFERENCE_KINDS = {"lead": ("graph",), "tail": ("graph",), "draft": ("graph", "eager")}


@dataclass
class _Segments:
    have: np.ndarray  # bool [n]: interval and forward marks present
    span: dict[str, np.ndarray]  # int64 [n] per segment
    clean: dict[str, np.ndarray]  # bool [n] per segment
    valid: dict[str, np.ndarray]  # bool [n] per segment: span measured

    def without_clean(self) -> dict[str, np.ndarray]:
        """Segments with steps but no clean one (their waits need a reference): their steps."""
        v, c = self.valid, self.clean
        return {k: v[k] for k in SEGMENTS if v[k].any() and not (v[k] & c[k]).any()}


def _segments(
    raw_ns: np.ndarray, g: np.ndarray, mark_ns: np.ndarray, mark_host_ns: np.ndarray,
    phase_ns: np.ndarray,
) -> _Segments:  # fmt: skip
    s_raw = raw_ns[:, 0]
    f0 = mark_ns[:, 0]
    f1 = mark_ns[:, 1]
    d0 = mark_ns[:, 2]
    h_f0 = mark_host_ns[:, 0]
    h_d0 = mark_host_ns[:, 2]
    drafted = d0 >= 0
    h_end = np.where(drafted, phase_ns[:, _DRAFT, 1], phase_ns[:, _SAMPLE, 1])
    have = (g[:, 0] >= 0) & (g[:, 1] >= g[:, 0]) & (f0 >= 0) & (f1 >= f0)
    # the tail ends at the drafter's start when there is one
    tail_end = np.where(drafted, d0, g[:, 1])
    tail_end_host = np.where(drafted, h_d0, h_end)
    span = {"lead": f0 - s_raw, "tail": tail_end - f1, "draft": g[:, 1] - d0}
    clean = {
        "lead": s_raw >= h_f0 + CLEAN_MARGIN_NS,
        "tail": f1 >= tail_end_host + CLEAN_MARGIN_NS,
        "draft": drafted & (d0 >= h_end + CLEAN_MARGIN_NS),
    }
    valid = {k: have & (span[k] >= 0) & (drafted if k == "draft" else True) for k in SEGMENTS}
    return _Segments(have, span, clean, valid)


def segments_without_clean(trace: Any) -> dict[str, np.ndarray]:
    """The segments of a finished run's steps (`engine.hooks.StepTrace`) that no step ran
    clean, with the steps that have them (bool [n]): `kernel_busy` can take their waits out
    only against a `SegmentReference`."""
    n = trace.num_steps
    marks = getattr(trace, "mark_ns", None)
    if marks is None or len(marks) != n or not n:
        return {}
    g, _ = _kernel_intervals(trace.gpu_ns[:n], trace.phase_ns[:n, _LAUNCH, 0])
    segs = _segments(trace.gpu_ns[:n], g, marks, trace.mark_host_ns, trace.phase_ns[:n])
    return segs.without_clean()


def kernel_busy(
    raw_ns: np.ndarray, g: np.ndarray, mark_ns: np.ndarray, mark_host_ns: np.ndarray,
    phase_ns: np.ndarray, graphed: np.ndarray, reference: SegmentReference | None = None,
    rows: np.ndarray | None = None, ctx: np.ndarray | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:  # fmt: skip
    """Narrow each step's GPU interval `g` to its kernel time. A step's events split its GPU
    work into segments: lead (start event -> forward: the input copies), forward (a CUDA graph
    replay runs without the host: kernels only; an eager forward is issued kernel by kernel
    and counts whole, as the simulator counts it), tail (forward end -> end event: the token
    copy, or sampling kernels) and, with the GPU drafter, draft (forward end -> drafter start)
    whose kernels follow the host's draft phase. A segment the host had fully enqueued before
    the GPU reached its first event ran back to back ("clean": its span is kernel time). The
    median clean span of a segment (per graph/eager kind) is its kernel time; a segment that is
    not clean holds idle = its span - that median (>= 0): the GPU waited for the host there.
    A segment kind with no clean step in the run takes its kernel time from `reference` (at
    each step's `rows` requests and `ctx` longest context) where one is given.
    Lead idle moves the start later, tail and draft idle move the end earlier, so the idle
    becomes a gap between steps and the bubble accounting names what the CPU was doing then.
    Returns the new intervals and the account (totals per segment, steps, clean counts)."""
    n = len(g)
    graph = np.asarray(graphed, bool)  # per step: the forward was a CUDA graph replay
    segs = _segments(raw_ns, g, mark_ns, mark_host_ns, phase_ns)
    have = segs.have
    idle = {}
    account: dict[str, Any] = {"steps": int(have.sum()), "margin_us": CLEAN_MARGIN_NS / 1e3}
    for name in SEGMENTS:
        span, clean, valid = segs.span[name], segs.clean[name], segs.valid[name]
        wait = np.zeros(n, np.int64)
        kernel_us: dict[str, float] = {}
        source: dict[str, str] = {}
        for kind, sel in (("graph", graph), ("eager", ~graph)):
            mine = valid & ~clean & sel
            ref = span[valid & clean & sel]
            if ref.size == 0:  # no clean step of this kind: the other kind's, else no estimate
                ref = span[valid & clean]
            if ref.size:
                est: np.ndarray | int = int(np.median(ref))
                kernel_us[kind] = est / 1e3
                source[kind] = "run"
            elif (
                reference is not None and name in reference.ns and kind in _REFERENCE_KINDS[name]
                and rows is not None and ctx is not None and mine.any()
            ):  # fmt: skip
                est = reference.at(name, rows[mine], ctx[mine]).astype(np.int64)
                kernel_us[kind] = float(np.median(est)) / 1e3
                source[kind] = "reference"
            else:
                continue
            wait[mine] = np.maximum(span[mine] - est, 0)
        idle[name] = wait
        account[name] = {
            "steps": int(valid.sum()),
            "clean": int((valid & clean).sum()),
            "kernel_us": kernel_us,  # the reference's: the median over the steps it served
            "kernel_source": source,
            "wait_s": float(wait.sum() / 1e9),
            # every step's span, clean or not: with no estimate (kernel_us empty) the
            # segment's waits stay in the busy time, and this says how long the segment ran
            "span_us": _quantiles_us(span[valid]),
        }
    if reference is not None:
        account["reference"] = reference.describe()
    s_raw = raw_ns[:, 0]
    out = g.copy()
    start = np.where(have, np.maximum(g[:, 0], s_raw + idle["lead"]), g[:, 0])
    end = np.where(have, g[:, 1] - idle["tail"] - idle["draft"], g[:, 1])
    out[:, 0] = np.where(have, np.minimum(start, end), g[:, 0])
    out[:, 1] = np.where(have, np.maximum(start, end), g[:, 1])
    account["removed_s"] = float(((g[:, 1] - g[:, 0]) - (out[:, 1] - out[:, 0]))[have].sum() / 1e9)
    return out, account


def _quantiles_us(span_ns: np.ndarray) -> dict[str, float]:
    """p10 / p50 / p90 of spans in ns, as us ({} for none)."""
    if span_ns.size == 0:
        return {}
    q = np.percentile(span_ns, [10, 50, 90]) / 1e3
    return {"p10": float(q[0]), "p50": float(q[1]), "p90": float(q[2])}


class _EmissionClock:
    """Maps an engine time stamp taken inside a process_outputs phase to that phase's end, and
    to the row (step) whose phase it is; stamps outside any such phase stay, with row -1."""

    def __init__(self, po_ns: np.ndarray, t0_ns: int) -> None:
        ok = (po_ns[:, 0] >= 0) & (po_ns[:, 1] >= po_ns[:, 0])
        rows = np.flatnonzero(ok)
        order = np.argsort(po_ns[rows, 0], kind="stable")
        self.rows = rows[order]
        self.start, self.end = po_ns[self.rows, 0], po_ns[self.rows, 1]
        self.t0 = t0_ns

    def at(self, stamps_ns: Sequence[int]) -> tuple[list[float], list[int]]:
        t = np.asarray(stamps_ns, np.int64)
        if self.start.size == 0:
            return ((t - self.t0) / 1e9).tolist(), [-1] * t.size
        i = np.searchsorted(self.start, t, side="right") - 1
        j = np.maximum(i, 0)
        inside = (i >= 0) & (t <= self.end[j])
        moved = np.where(inside, self.end[j], t)
        rows = np.where(inside, self.rows[j], -1)
        return ((moved - self.t0) / 1e9).tolist(), rows.tolist()


def _runs(items: list[tuple[float, int]]) -> list[tuple[tuple[float, int], int]]:
    """Equal consecutive (time, row) -> ((time, row), count): tokens one step emitted."""
    out: list[tuple[tuple[float, int], int]] = []
    for it in items:
        if out and out[-1][0] == it:
            out[-1] = (it, out[-1][1] + 1)
        else:
            out.append((it, 1))
    return out


# ---- instrumentation overhead --------------------------------------------------------------------
HOOK_CALLS_PER_STEP = 2 * len(CPU_PHASES) + 7  # begin/end pairs, new_row, 4 GPU marks, a sync


def step_hook_calls(h: Any, shape: Any) -> None:
    """The hook calls of one plain engine step, in the order `Engine._launch`, `_draft` and
    `_complete` make them (with a sync wait, which a step without one skips)."""
    h.begin(P.SCHEDULE)
    row = h.new_row(shape)
    h.end(row)
    h.begin(P.PREPARE_INPUTS)
    h.gpu_begin(row)
    h.end(row)
    h.begin(P.LAUNCH)
    h.graphed[row] = 1
    h.mark(row, 0)  # before and after the forward
    h.mark(row, 1)
    h.end(row)
    h.begin(P.SAMPLE)
    h.gpu_end(row)
    h.end(row)
    h.begin(P.DRAFT)
    h.end(row)
    t0 = h.sync_begin()
    h.sync_end(row, t0)
    h.begin(P.PROCESS_OUTPUTS)
    h.finished[row] = 1
    h.end(row)


def hook_overhead(
    device: Any, steps: int = 2000, trials: int = 5, harvests: bool = True
) -> dict[str, float]:
    """Per-step cost of the hooks the engine calls in one step (`step_hook_calls`) and of one
    GC callback pair, timed on spare StepHooks: the median over `trials` runs of `steps` steps
    (after a warm-up), minus an empty loop of as many iterations. `harvests`: each step also
    reads the GPU events of a step a ring ago (CUDA), as in a run longer than its event ring;
    off for a run within its ring, whose events are all read in `finish()`, after the run."""
    dev = torch.device(device)
    shape = BatchShape(num_reqs=1, decode_tokens=1)
    info = {"generation": 0, "collected": 0, "uncollectable": 0}
    ring = 256 if harvests else steps + 300
    step_ns, gc_ns = [], []
    for _ in range(trials):
        h = StepHooks(dev, capacity=steps + 300, ring=ring)
        h.start()
        for _ in range(256 + 8):  # first calls (with harvests a full ring: each timed step reads)
            step_hook_calls(h, shape)
        base = _empty_loop_ns(steps)
        t = time.perf_counter_ns()
        for _ in range(steps):
            step_hook_calls(h, shape)
        step_ns.append((time.perf_counter_ns() - t - base) / steps)
        h.finish()
        t = time.perf_counter_ns()
        for _ in range(steps):
            h.on_gc("start", info)
            h.on_gc("stop", info)
        gc_ns.append((time.perf_counter_ns() - t - base) / steps)
    if gc.isenabled():
        gc.collect(0)
    return {
        "per_step_us": max(0.0, statistics.median(step_ns)) / 1e3,
        "gc_callback_us": max(0.0, statistics.median(gc_ns)) / 1e3,
    }


def _empty_loop_ns(n: int) -> int:
    t = time.perf_counter_ns()
    for _ in range(n):
        pass
    return time.perf_counter_ns() - t


def overhead_summary(cost: dict[str, float], summary: dict[str, Any]) -> dict[str, Any]:
    """Instrumentation time as a fraction of the time the loop was stepping: the span less
    the idle time with no request in the engine (`idle_s`), which holds no steps; mean step
    time = that / steps."""
    steps = summary.get("num_steps") or 0
    stepping_s = max(0.0, (summary.get("span_s") or 0.0) - (summary.get("idle_s") or 0.0))
    gcs = (summary.get("gc") or {}).get("count", 0)
    total_us = cost["per_step_us"] * steps + cost["gc_callback_us"] * gcs
    mean_step_us = stepping_s * 1e6 / steps if steps else None
    return {
        **cost,
        "calls_per_step": HOOK_CALLS_PER_STEP,
        "mean_step_us": mean_step_us,
        "overhead_fraction": total_us / (stepping_s * 1e6) if stepping_s > 0 else None,
    }
