"""Kernel time of a step's segments measured outside the run, for the runs whose host never
gets ahead of the GPU (replay.gpu.measure.kernel_busy).

kernel_busy takes a GPU wait for the host out of a step's interval against the segment's clean
span in the same run. A run where the host always trails the GPU drafter (ngram-gpu on
llama3.2-1b: the proposer's few dozen small kernels trickle in over ~1.2-1.4 ms of host
launch while they run ~0.2 ms) has no clean drafter segment, so its waits stayed in the busy
time. Here the same engine, after the run, launches synthetic decode steps of the run's sizes
(replay.gpu.shapes_step: the run's own launch path) behind a GPU spin, so the host has enqueued
all of each step before the GPU reaches it, and times each segment between the engine's own
marks:

    lead  = gpu_begin -> forward_begin      (input copies)
    tail  = forward_end -> draft_begin | gpu_end
    draft = draft_begin -> gpu_end          (the GPU drafter)

at a small grid of (requests, longest context) points spanning the steps that need it. The
drafter reads a window as wide as the batch's longest row (engine.spec.ngram_gpu), so context is
an axis; a row count past the largest graph bucket runs eager, as in the run.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from engine.hooks import MARKS
from replay.analysis.shapes_grid import Batch, Entry
from replay.gpu.measure import SEGMENTS, SegmentReference
from replay.gpu.shapes_step import MarkHooks, StageError, stage
from replay.gpu.spintimer import Timer

REPEATS = 5
ROW_QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)
CTX_QUANTILES = (0.1, 0.9)
_FB, _FE, _DB = (MARKS.index(m) for m in ("forward_begin", "forward_end", "draft_begin"))
_now = time.perf_counter_ns


class SegmentMarks(MarkHooks):
    """MarkHooks that also takes the engine's marks (forward begin/end, drafter begin) of the
    sampled step, on the sweep's own events (CUDA) or as host times (CPU)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.marked = [False] * len(MARKS)
        self.mark_host = [0] * len(MARKS)
        if self.cuda:
            self.mark_ev = [torch.cuda.Event(enable_timing=True) for _ in MARKS]

    def gpu_begin(self, row: int) -> None:
        self.marked = [False] * len(MARKS)
        super().gpu_begin(row)

    def mark(self, row: int, m: int) -> None:
        if self.cuda:
            self.mark_ev[m].record()
        self.mark_host[m] = _now()
        self.marked[m] = True

    def segments_ns(self) -> dict[str, int]:
        """The sampled step's segments (CUDA: call after the device is synchronized)."""
        at = self._times_ns()
        tail_end = at.get("db", at["end"])  # the drafter starts where the tail ends
        out = {"lead": at["fb"], "tail": tail_end - at["fe"]}
        if "db" in at:
            out["draft"] = at["end"] - at["db"]
        return out

    def _times_ns(self) -> dict[str, int]:
        """Each mark's time from the start mark, ns (`db` only where the drafter ran)."""
        if not (self.marked[_FB] and self.marked[_FE]):
            raise RuntimeError("the step set no forward marks")
        keys = {"fb": _FB, "fe": _FE, "db": _DB}
        if self.cuda:
            t = {k: self.start_ev.elapsed_time(self.mark_ev[m]) for k, m in keys.items()
                 if self.marked[m]}  # fmt: skip
            t["end"] = self.start_ev.elapsed_time(self.end_ev)
            return {k: int(v * 1e6) for k, v in t.items()}
        out = {k: self.mark_host[m] - self.begin_ns for k, m in keys.items() if self.marked[m]}
        return out | {"end": self.end_ns - self.begin_ns}


def grid_points(rows: np.ndarray, ctx: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The reference's (requests, longest context) axes: quantiles of the steps it serves."""
    r = sorted({max(1, int(round(x))) for x in np.quantile(rows, ROW_QUANTILES)})
    c = sorted({max(1, int(round(x))) for x in np.quantile(ctx, CTX_QUANTILES)})
    return tuple(r), tuple(c)


def decode_batch(engine: Any, rows: int, ctx: int) -> Batch:
    """`rows` decode rows at context `ctx`, each with the engine's draft count."""
    k = engine.q - 1
    start = max(1, min(ctx, engine.max_model_len - k - 2))
    e = Entry(start=start, n=1 + k, prefill=False, drafts=k)
    return Batch(label=f"segref-r{rows}-c{start}", entries=(e,) * rows)


def measure(
    engine: Any, rows: tuple[int, ...], ctx: tuple[int, ...], repeats: int = REPEATS
) -> SegmentReference:
    """Each segment's median clean span at every (rows, ctx) point, on `engine` (its requests
    are dropped: call once its run is over; its hooks are put back)."""
    hooks = engine.hooks
    marks = SegmentMarks(engine.device)
    engine.hooks = marks
    timer = Timer.create(engine.device.type == "cuda")
    spans: dict[str, list[list[float]]] = {k: [] for k in SEGMENTS}
    try:
        with torch.no_grad():
            for r in rows:
                for k in SEGMENTS:
                    spans[k].append([])
                for c in ctx:
                    got = _point(engine, marks, timer, decode_batch(engine, r, c), repeats)
                    for k in SEGMENTS:
                        spans[k][-1].append(got.get(k, np.nan))
    finally:
        engine.reset_requests()
        engine.hooks = hooks
    ns = {k: np.array(v, np.float64) for k, v in spans.items()}
    ns = {k: v for k, v in ns.items() if np.isfinite(v).all()}
    return SegmentReference(rows, ctx, ns)


def _point(engine: Any, marks: SegmentMarks, timer: Timer, batch: Batch, repeats: int) -> dict:
    """Median span per segment over `repeats` clean samples ({} if none came clean)."""
    try:
        st = stage(engine, batch, engine.cfg.seed)
    except StageError:
        return {}
    path = "graph" if st.bucket else "eager"
    timer.prime(st, marks, path)
    got: dict[str, list[int]] = {}
    for _ in range(repeats):
        s, _bad = timer.sample(st, marks, path)
        if s is None:
            continue
        for k, v in marks.segments_ns().items():
            got.setdefault(k, []).append(v)
    return {k: float(np.median(v)) for k, v in got.items()}
