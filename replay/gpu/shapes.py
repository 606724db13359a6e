"""Clean GPU timings of synthetic engine steps (`python -m replay shapes`), for calibration.

A measured run's GPU interval holds kernels alone only when the GPU began the step after the host
had issued all of it (replay.analysis.steps, "clean"); an eager step of a small model is launched
more slowly than its kernels run, so nearly none of its mixed steps is clean. This sweep times the
engine's own step on a grid of synthetic batches with the launch hidden behind a GPU spin:

    GPU spin (torch.cuda._sleep) | the step: Engine.launch_batch, gpu_begin .. gpu_end marks

What one sample measures is what a run step's GPU interval measures (`measures: "step"` in the
file): the same `Engine` (model, KV cache, input buffers, decode CUDA graphs with their input
finishing and sampling, the eager path with sampling for mixed steps, the spec decoder's
verification and ngram-gpu proposer), on a batch its scheduler made from requests already in
the KV cache (replay.gpu.shapes_step), between the marks the engine's hooks set: from before the
input copy (`inputs.send`) to after the token copy (or the GPU proposer). The marks are taken on
the sweep's events (replay.gpu.shapes_step.MarkHooks). The host enqueues the spin, then the whole
step; the start mark fires only once the spin ends. A sample is clean when, at the end mark,
the start mark has still not fired (`Event.query`, which never blocks): every kernel of the
step was queued before the GPU began it. A sample that is not clean is retried with a spin
twice as long, then dropped and counted. The device is synchronized after each sample. On CPU
there is no spin: a sample is the host time between the marks of a synchronous step.

Before the grid, on CUDA, the engine's compile warm-up (engine.warmup's forward plan, compiled
16 at a time, as `replay run` does). Per shape: one untimed launch (Triton compiles, cuBLAS
loads, held rows' block tables reach the device; the first shape of each path, graph or eager,
one more to seed the issue-time estimate), then `repeats` samples (fewer for steps over
LONG_SAMPLE_MS). The grid (replay.analysis.shapes_grid) is cut (replay.analysis.shapes_plan) to
`points` shapes and an estimated GPU time `budget_s` in level order, so what is left out is
refinement; the estimate is printed before the sweep starts. The file (replay.analysis.shapes_file)
is rewritten every WRITE_EVERY_S and at the end, whole each time; a sweep cut by --max-seconds,
SIGTERM or Ctrl-C writes what it has timed (`complete: false`).
"""

from __future__ import annotations

import datetime as dt
import gc
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bubblesim.core.config import Config
from engine.engine import Engine
from engine.tp.workers import stop_all as stop_tp_workers
from replay.analysis.shapes_file import (
    COLUMNS,
    FORMAT_VERSION,
    KINDS,
    MEASURES,
    META_KEY,
    SHAPE_COLUMNS,
    Sample,
    SweepRows,
    read_sweep,
    read_sweeps,
    shape_row,
    write_sweep,
)
from replay.analysis.shapes_grid import Batch, Entry, Limits, axes_of, batch_shape, grid
from replay.analysis.shapes_plan import DEFAULT_BUDGET_S, Plan, envelope, plan
from replay.gpu.run import as_run, gpu_name, versions
from replay.gpu.shapes_step import SCATTER_MAX_BLOCKS as scatter_max
from replay.gpu.shapes_step import MarkHooks, StageError, stage
from replay.gpu.spintimer import Timer

__all__ = [
    "COLUMNS",
    "FORMAT_VERSION",
    "KINDS",
    "MEASURES",
    "META_KEY",
    "SHAPE_COLUMNS",
    "Batch",
    "Entry",
    "Limits",
    "Sample",
    "SweepResult",
    "SweepRows",
    "batch_shape",
    "grid",
    "plan",
    "read_sweep",
    "read_sweeps",
    "shape_row",
    "sweep",
    "write_sweep",
]

WRITE_EVERY_S = 15.0
LONG_SAMPLE_MS = 50.0  # shapes whose first sample takes longer get at most LONG_REPEATS
LONG_REPEATS = 3


# ---- the sweep ----------------------------------------------------------------------------------
@dataclass
class SweepResult:
    path: Path
    rows: int
    counts: dict[str, int]  # per kind
    dropped_shapes: int  # no clean sample
    unclean_samples: int
    wrapped_shapes: int
    wall_s: float
    gpu_busy_s: float  # spins + timed steps (+ untimed launches, not counted)
    complete: bool
    meta: dict[str, Any]


class SweepCut(Exception):
    """SIGTERM arrived during a sweep."""


def sweep(
    cfg: Config,
    out: str | Path,
    repeats: int = 5,
    kinds: Sequence[str] = KINDS,
    quick: int = 0,
    max_seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
    budget_s: float | None = DEFAULT_BUDGET_S,
    points: int | None = None,
    max_context: int = 0,
    announce: Callable[[str], None] | None = None,
    families: Sequence[str] = (),
    batches: Sequence[Batch] | None = None,
) -> SweepResult:
    """Time the grid's steps for `cfg` (module docstring); write the parquet file `out`.
    `quick` > 0: about that many shapes per kind (no budget). `max_seconds`: stop adding shapes
    after that long. `announce` gets the plan (shapes, estimated GPU time) before timing.
    `families`: only these grid families (replay.analysis.shapes_grid.FAMILIES; none: all).
    `batches`: these batches instead of the grid, in order (replay.analysis.batches_file; the
    grid's limits are still recorded), each under its own label."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    t_start = time.monotonic()
    threads = torch.get_num_threads()
    if cfg.device == "cpu":
        torch.set_num_threads(1)  # as replay run: intra-op threads make CPU timings erratic
    was_enabled = gc.isenabled()
    rows: list[dict[str, Any]] = []
    stats = _stats()
    try:
        engine = Engine(cfg)
        engine.hooks = marks = MarkHooks(engine.device)
        buckets = engine.graphs.buckets if engine.graphs is not None else ()
        pl = plan(
            _as_run(cfg), engine.num_kv_blocks, kinds, quick, repeats, budget_s, points,
            max_context, buckets, families,
        )  # fmt: skip
        if batches is not None:  # given batches instead of the grid (no estimate)
            pl = Plan(list(batches), len(batches), 0.0, pl.limits, ("batches",))
        if announce is not None:
            announce(
                f"grid: {len(pl.batches)} of {pl.grid_shapes} shapes, estimated GPU time "
                f"{pl.estimate_s:.0f} s (budget {budget_s or 0:g} s; cache "
                f"{engine.num_kv_blocks} blocks)"
            )
        stats["warmup_s"] = warm_up(engine)
        timer = Timer.create(engine.device.type == "cuda")
        meta_of = _meta_fn(
            cfg, engine, timer, stats, rows, pl, (repeats, budget_s, points), t_start
        )
        gc.collect()
        gc.disable()  # a collection inside a host issue would only cost a retry
        with torch.no_grad(), _sigterm_raises():
            try:
                _time_all(engine, marks, timer, pl, repeats, rows, stats, t_start, max_seconds,
                          progress, lambda: write_sweep(out, rows, meta_of()))  # fmt: skip
            except (SweepCut, KeyboardInterrupt) as e:
                stats["complete"] = False
                stats["stopped"] = "SIGTERM" if isinstance(e, SweepCut) else "interrupted"
    finally:
        if was_enabled:
            gc.enable()
        torch.set_num_threads(threads)
        stop_tp_workers()  # tensor parallelism: the engine's worker ranks
    stats["gpu_busy_s"] += timer.spin_s
    meta = meta_of()
    path = write_sweep(out, rows, meta)
    return SweepResult(
        path=path,
        rows=len(rows),
        counts={k: sum(1 for r in rows if r["kind"] == k) for k in KINDS},
        dropped_shapes=stats["dropped_shapes"],
        unclean_samples=stats["unclean_samples"],
        wrapped_shapes=stats["kv_wrapped_shapes"],
        wall_s=time.monotonic() - t_start,
        gpu_busy_s=stats["gpu_busy_s"],
        complete=stats["complete"],
        meta=meta,
    )


def _stats() -> dict[str, Any]:
    return dict(
        shapes=0,
        dropped_shapes=0,
        unstaged_shapes=0,
        unclean_samples=0,
        kv_wrapped_shapes=0,
        gpu_busy_s=0.0,
        warmup_s=0.0,
        complete=True,
        stopped=None,
    )


def warm_up(engine: Any) -> float:
    """CUDA with Triton kernels: every compile an eager step of the config can select, 16 at
    a time (engine.warmup's forward plan, as `replay run` warms up), so the grid's untimed
    launches meet few; they would compile one by one. Returns the seconds it took."""
    t0 = time.perf_counter()
    if engine.device.type == "cuda" and getattr(engine.model, "kernels", None) is not None:
        # every tensor-parallel rank runs the same forwards (Engine.warm_forwards)
        engine.warm_forwards(min(16, os.cpu_count() or 1))
    return time.perf_counter() - t0


def _as_run(cfg: Config) -> Config:
    """On CUDA the GPU preset the device is (for the cost estimate)."""
    return as_run(cfg)


class _sigterm_raises:
    """SIGTERM raises SweepCut while the sweep times (main thread only), so the rows timed so
    far are written."""

    def __enter__(self) -> None:
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._raise)

    def __exit__(self, *exc: object) -> None:
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise SweepCut()


def _time_all(
    engine: Any,
    marks: Any,
    timer: Timer,
    pl: Plan,
    repeats: int,
    rows: list[dict[str, Any]],
    stats: dict[str, Any],
    t_start: float,
    max_seconds: float | None,
    progress: Callable[[str], None] | None,
    save: Callable[[], Any],
) -> None:
    stats["shapes"] = len(pl.batches)
    last_write = time.monotonic()
    for i, batch in enumerate(pl.batches):
        if max_seconds is not None and time.monotonic() - t_start > max_seconds:
            stats["complete"] = False
            stats["stopped"] = "max_seconds"
            break
        if progress is not None:
            progress(f"shape {i + 1}/{len(pl.batches)}: {batch.kind} {batch.label}")
        try:
            staged = stage(engine, batch, engine.cfg.seed)
        except StageError:
            stats["unstaged_shapes"] += 1
            continue
        row = _time_batch(engine, marks, timer, staged, repeats, stats)
        if row is not None:
            rows.append(row)
        if time.monotonic() - last_write > WRITE_EVERY_S:
            stats["complete"] = False  # until the last row
            save()
            stats["complete"] = True
            last_write = time.monotonic()
    engine.reset_requests()


def _time_batch(
    engine: Any, marks: Any, timer: Timer, st: Any, repeats: int, stats: dict[str, Any]
) -> dict[str, Any] | None:
    path = "graph" if st.bucket else "eager"
    timer.prime(st, marks, path)
    samples: list[Sample] = []
    unclean = 0
    want = repeats
    while len(samples) < want:
        s, bad = timer.sample(st, marks, path)
        unclean += bad
        if s is None:
            break  # the host could not get ahead of the GPU even with a longer spin
        samples.append(s)
        stats["gpu_busy_s"] += s.gpu_ms / 1e3
        if len(samples) == 1 and s.gpu_ms > LONG_SAMPLE_MS:
            want = min(repeats, LONG_REPEATS)
    stats["unclean_samples"] += unclean
    stats["kv_wrapped_shapes"] += int(st.wrapped)
    if not samples:
        stats["dropped_shapes"] += 1
        return None
    q = engine.q if st.bucket else 0  # graphs: the bounds they were captured with
    max_q = q or st.batch.max_query_len
    max_seq = engine.max_model_len if st.bucket else st.batch.max_seq_len
    spec_k = engine.cfg.spec.k if engine.sd is not None else 0
    return shape_row(
        st.batch, samples, unclean, st.bucket, max_seq, st.kv_blocks, st.wrapped,
        st.sched_batch.shape.as_dict(), spec_k, max_q,
    )  # fmt: skip


def _meta_fn(
    cfg: Config,
    engine: Any,
    timer: Timer,
    stats: dict[str, Any],
    rows: list[dict[str, Any]],
    pl: Plan,
    cut: tuple[int, float | None, int | None],
    t_start: float,
) -> Callable[[], dict[str, Any]]:
    """The file's metadata, built when written (rows and stats grow during the sweep); `cut`:
    repeats, budget_s, points."""
    repeats, budget_s, points = cut
    commit, dirty = engine_commit()
    fixed = {
        "format": "replay.shapes",
        "version": FORMAT_VERSION,
        "measures": MEASURES,
        "timed": "a run step's GPU interval: Engine.launch_batch between the hooks' gpu_begin "
        "(before inputs.send) and gpu_end (after the token copy; ngram-gpu: after the "
        "proposer), decode graphs with their input finishing and sampling, eager mixed steps "
        "with sampling, spec verification",
        "model": cfg.model,
        "gpu": gpu_name(cfg),
        "dtype": cfg.dtype,
        "torch_dtype": str(engine.model.dtype).removeprefix("torch."),
        "device": cfg.device,
        "attn_backend": engine.model.attn_backend,
        "cuda_graphs": engine.graphs is not None,
        "graph_buckets": list(engine.graphs.buckets) if engine.graphs is not None else [],
        # the KV block ids the synthetic batches read (replay.gpu.shapes_step.give_blocks)
        "kv_layout": "scattered" if engine.num_kv_blocks <= scatter_max else "consecutive",
        "graphs_sample": bool(engine.graphs is not None and engine.graphs.samples),
        "spec": {"method": cfg.spec.method, "k": cfg.spec.k if cfg.spec.enabled else 0},
        # calibrate joins a sweep only to runs of the same degree (sim.cost.profile.TP_KEY)
        "tensor_parallel_size": cfg.tensor_parallel_size,
        **versions(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "engine_commit": commit,
        "engine_dirty": dirty,
        "config": cfg.to_dict(),
        "max_model_len": engine.max_model_len,
        "num_kv_blocks": engine.num_kv_blocks,
        "kv_tokens": engine.num_kv_blocks * cfg.block_size,
        "spin_cycles_per_ms": timer.cycles_per_ms,
        "grid": {
            "limits": {
                "max_num_batched_tokens": pl.limits.max_tokens,
                "max_num_seqs": pl.limits.max_seqs,
                "max_model_len": pl.limits.max_len,
                "max_context": pl.limits.context_cap,
                "kv_tokens": min(pl.limits.kv_tokens, engine.num_kv_blocks * cfg.block_size),
                "spec_k": pl.limits.spec_k,
            },
            "grid_shapes": pl.grid_shapes,
            "families": list(pl.families) or "all",
            "selected_shapes": len(pl.batches),
            "budget_s": budget_s,
            "points": points,
            "repeats": repeats,
            "estimated_gpu_s": pl.estimate_s,
            "levels": {str(k): v for k, v in sorted(Counter(b.level for b in pl.batches).items())},
            "axes": axes_of(pl.batches),
        },
    }

    def meta() -> dict[str, Any]:
        return {
            **fixed,
            **stats,
            "envelope": envelope(rows),
            "wall_s": time.monotonic() - t_start,
        }

    return meta


def engine_commit() -> tuple[str | None, bool | None]:
    """HEAD of the repository holding engine/, and whether engine/ or bubblesim/core/ differ
    from it."""
    root = Path(__file__).resolve().parents[2]  # replay/gpu/shapes.py -> the repository
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "engine", "bubblesim/core"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head or None, bool(status.strip())
