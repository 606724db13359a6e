"""Decode graphs timed after set GPU idle gaps (`python -m replay idlegap`), for the idle-start law.

Whether a decode CUDA graph issued to an idle GPU runs shorter than one queued behind other
work (sim.stream.IdleStart; replay.analysis.idle_start fits the law from a run's idle-start
steps), measured without a run, so that a model whose depth-2 runs never idle the GPU is
covered too (H100, 2026-11-26: no saving on llama3.2-1b or llama3-8b at any gap; the saving
runs once showed was the hooks' clock drift, reports/fidelity/README.md section 0). For each
decode graph shape of a short grid (the same synthetic steps as `replay shapes`,
replay.gpu.shapes_step):

    queued: GPU spin | the step                      (replay.gpu.spintimer.Timer: the pass)
    idle g: previous step | sync, idle mark | host waits g ms | the step

An idle sample's measured idle is the GPU time from the idle mark (an event recorded on the
idle stream right after the synchronize) to the step's start mark, so it holds the host wait
and the host's issue of the step up to its first GPU work, as a run's `gpu_idle_before_s` does.
The step before each idle sample is the same graph (its previous sample), as in a run where a
decode step follows a decode step. Gaps are taken in a rotating order per repeat, so a drift of
the GPU's state over a shape's samples does not line up with one gap. On CPU (tests) there is
no GPU and no graph: eager decode steps, the idle is the host wait and the step's interval is
host time (the plumbing, not the law).

The file (replay.analysis.idlegap_file) holds one row per sample with its shape's queued median;
`replay calibrate --idle-sweep FILE` fits the law from it.
"""

from __future__ import annotations

import datetime as dt
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bubblesim.core.config import Config
from engine.engine import Engine
from engine.tp.workers import stop_all as stop_tp_workers
from replay.analysis.idlegap_file import FORMAT, write_idlegap
from replay.analysis.shapes_plan import plan
from replay.gpu.run import as_run, gpu_name, versions
from replay.gpu.shapes import engine_commit, warm_up
from replay.gpu.shapes_step import MarkHooks, Staged, StageError, stage
from replay.gpu.spintimer import Timer

DEFAULT_GAPS_MS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
DEFAULT_SHAPES = 12  # decode shapes (about; the grid's quick selection)


@dataclass
class IdleGapResult:
    path: Path
    shapes: int
    samples: int
    dropped_shapes: int  # no clean queued sample
    wall_s: float
    meta: dict[str, Any]


def _wait_ms(ms: float) -> None:
    """Busy-wait on the host (a sleep would let the thread be descheduled past the gap)."""
    end = time.perf_counter_ns() + int(ms * 1e6)
    while time.perf_counter_ns() < end:
        pass


class IdleTimer:
    """One sample of a staged step issued after the GPU has been idle for about `gap_ms`."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        if cuda:
            self.idle_ev = torch.cuda.Event(enable_timing=True)

    def sample(self, st: Staged, marks: MarkHooks, gap_ms: float) -> tuple[float, float]:
        """(measured idle ms, step GPU ms)."""
        st.before()
        if self.cuda:
            torch.cuda.synchronize()  # the previous sample's work is done: the GPU is idle
            self.idle_ev.record()
        t0 = time.perf_counter_ns()
        _wait_ms(gap_ms)
        st.launch()
        if self.cuda:
            torch.cuda.synchronize()
            idle_ms = float(self.idle_ev.elapsed_time(marks.start_ev))
        else:
            idle_ms = (marks.begin_ns - t0) / 1e6
        st.after()
        return idle_ms, marks.gpu_ms()


def sweep_idle(
    cfg: Config,
    out: str | Path,
    gaps_ms: Sequence[float] = DEFAULT_GAPS_MS,
    repeats: int = 5,
    shapes: int = DEFAULT_SHAPES,
    max_seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> IdleGapResult:
    """Time `shapes` decode graph shapes queued and after each gap of `gaps_ms`, `repeats`
    times each; write the parquet file `out` (module docstring)."""
    if repeats < 1 or shapes < 1:
        raise ValueError("repeats and shapes must be >= 1")
    if not gaps_ms or min(gaps_ms) < 0:
        raise ValueError("gaps must be a non-empty list of ms >= 0")
    t_start = time.monotonic()
    rows: list[dict[str, Any]] = []
    dropped = 0
    was_enabled = gc.isenabled()
    try:
        engine = Engine(cfg)
        cuda = engine.device.type == "cuda"
        if cuda and engine.graphs is None:
            raise ValueError("the idle-gap sweep times decode CUDA graphs: set cuda_graphs=true")
        engine.hooks = marks = MarkHooks(engine.device)
        buckets = engine.graphs.buckets if engine.graphs is not None else ()
        pl = plan(
            as_run(cfg), engine.num_kv_blocks, ("decode",), quick=shapes, repeats=repeats,
            buckets=buckets,
        )  # fmt: skip
        warm_up(engine)
        timer = Timer.create(engine.device.type == "cuda")
        idle = IdleTimer(timer.cuda)
        gc.collect()
        gc.disable()  # a collection inside a gap or an issue would blur the gap
        with torch.no_grad():
            for i, batch in enumerate(pl.batches):
                if max_seconds is not None and time.monotonic() - t_start > max_seconds:
                    break
                if progress is not None:
                    progress(f"shape {i + 1}/{len(pl.batches)}: {batch.label}")
                try:
                    st = stage(engine, batch, cfg.seed)
                except StageError:
                    continue
                if cuda and not st.bucket:
                    continue  # an eager decode step (over the largest graph): not a graph
                got = _time_shape(st, marks, timer, idle, gaps_ms, repeats, i)
                if got is None:
                    dropped += 1
                else:
                    rows.extend(got)
            engine.reset_requests()
    finally:
        if was_enabled:
            gc.enable()
        stop_tp_workers()
    meta = _meta(cfg, engine, gaps_ms, repeats, shapes, dropped, t_start)
    path = write_idlegap(out, rows, meta)
    return IdleGapResult(
        path, len({r["shape"] for r in rows}), len(rows), dropped, time.monotonic() - t_start, meta
    )


def _time_shape(
    st: Staged, marks: MarkHooks, timer: Timer, idle: IdleTimer, gaps_ms: Sequence[float],
    repeats: int, index: int,
) -> list[dict[str, Any]] | None:  # fmt: skip
    """The shape's idle samples, each with the shape's queued median; None: no clean queued
    sample."""
    path = "graph" if st.bucket else "eager"  # eager: CPU only (tests)
    timer.prime(st, marks, path)
    queued = []
    for _ in range(repeats):
        s, _bad = timer.sample(st, marks, path)
        if s is not None:
            queued.append(s.gpu_ms)
    if not queued:
        return None
    queued_ms = float(np.median(queued))
    shape = st.sched_batch.shape
    rows = []
    n = len(gaps_ms)
    for r in range(repeats):
        for j in range(n):
            gap = float(gaps_ms[(j + r) % n])  # rotated per repeat
            idle_ms, gpu_ms = idle.sample(st, marks, gap)
            rows.append(
                {
                    "shape": index,
                    "label": st.batch.label,
                    "num_reqs": int(shape.num_reqs),
                    "draft_tokens": int(shape.draft_tokens),
                    "kv_read_tokens": int(shape.kv_read_tokens),
                    "bucket": int(st.bucket),
                    "gap_ms": gap,
                    "idle_ms": idle_ms,
                    "gpu_ms": gpu_ms,
                    "queued_ms": queued_ms,
                    "queued_samples": len(queued),
                }
            )
    return rows


def _meta(
    cfg: Config, engine: Any, gaps_ms: Sequence[float], repeats: int, shapes: int, dropped: int,
    t_start: float,
) -> dict[str, Any]:  # fmt: skip
    commit, dirty = engine_commit()
    return {
        "format": FORMAT,
        "model": cfg.model,
        "gpu": gpu_name(cfg),
        "dtype": cfg.dtype,
        "device": cfg.device,
        "spec": {"method": cfg.spec.method, "k": cfg.spec.k if cfg.spec.enabled else 0},
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "graph_buckets": list(engine.graphs.buckets) if engine.graphs is not None else [],
        "gaps_ms": [float(g) for g in gaps_ms],
        "repeats": repeats,
        "shapes_asked": shapes,
        "dropped_shapes": dropped,
        "wall_s": time.monotonic() - t_start,
        **versions(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "engine_commit": commit,
        "engine_dirty": dirty,
        "config": cfg.to_dict(),
    }
