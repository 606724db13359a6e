"""A measured run (`python -m replay run`): trace + config -> the engine -> run folder (Contract 3).

Per repeat: a fresh `engine.Engine` (weights built once and shared, so no repeat sees another's
prefix cache or GC heap), a warm-up, fresh hooks, then `Engine.run` over the trace with arrivals
in real time (config `arrival=realtime`, open loop) or all at once (`asap`). The warm-up
(engine.warmup) meets every Triton compile an eager step within the config's limits can select
(model forwards over the shape classes, then requests over the token-count classes), then a few
synthetic requests for the other first-call costs (allocator, lazy init). Triton compiles are
counted during the warm-up and the measured run (replay.gpu.compiles) and reported in
summary.json `replay.jit_compiles`: the measured run should have none. The hooks' record and the
per-request outputs become a `RunRecorder` (replay.gpu.measure) and `write_run` writes the folder
atomically.

Interruptions (Ctrl-C, an engine error, `--max-seconds`): whatever was measured up to then is
written as a run with `complete: false`, and the error is re-raised (Ctrl-C: exit 130).
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bubblesim.core.config import Config, ConfigError
from bubblesim.core.gpus import GPUS
from bubblesim.core.models import get_model, with_context
from bubblesim.core.request import Request
from bubblesim.core.runfmt import trace_info, write_run
from bubblesim.core.runfmt.bubbles import account_bubbles
from bubblesim.core.runfmt.metrics import flat_metrics, spread
from bubblesim.core.runfmt.summary import build_summary
from bubblesim.core.trace import Trace, TraceError, read_trace
from engine import warmup as W
from engine.engine import Engine
from engine.hooks import StepHooks
from engine.requests import RequestInput
from engine.tp.ranktimes import empty_table
from engine.tp.workers import stop_all as stop_tp_workers
from replay.analysis.ranks import write_ranks
from replay.gpu import segref
from replay.gpu.compiles import CompileCounter
from replay.gpu.measure import (
    SegmentReference,
    hook_overhead,
    overhead_summary,
    segments_without_clean,
    to_recorder,
)
from replay.gpu.probe import PROBE_DIR, probe_inputs, probe_trace_info

WARMUP_SHAPES = ((48, 6), (200, 4), (16, 3))  # (prompt, output) of the warm-up requests
WARMUP_KEY = 1 << 30  # warm-up requests' sampling/prompt keys, far from the trace's 0..n-1
MAX_EVENT_RING = 1 << 16  # CUDA event pairs of the measured hooks (engine.hooks)


class ReplayTimeout(Exception):
    """--max-seconds ran out."""


@dataclass
class Measured:
    """One repeat: the recorder, summary numbers (write_run's own), and how it ended."""

    recorder: Any  # RunRecorder
    extra: dict[str, Any]  # summary["replay"]
    summary: dict[str, Any]  # build_summary of the recorder (no trace/source)
    complete: bool
    error: BaseException | None
    event_ring: int = 256  # the measured hooks' CUDA event ring (steps read only at the end)
    probe: Measured | None = None  # the host probe served just before (replay.gpu.probe)
    # tensor parallelism: the worker ranks' launches (engine.tp.ranktimes; empty without), and
    # the run's zero ns they are written against
    rank_ns: np.ndarray = field(default_factory=empty_table)
    t0_ns: int = 0


@dataclass
class ReplayResult:
    summary: dict[str, Any]  # of the folder written
    out: Path
    wall_s: float
    repeats: list[dict[str, Any]] = field(default_factory=list)  # flat metrics per repeat


def gpu_name(cfg: Config) -> str:
    if cfg.device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()})"


def as_run(cfg: Config) -> Config:
    """The config a measured run records: on CUDA its `gpu` is the preset the device is (the
    preset's name in the device name, e.g. 'h200' in 'NVIDIA H200'), so a run says what it ran
    on; the default preset ('h100') otherwise stood in the summaries of H200 runs."""
    if cfg.device != "cuda":
        return cfg
    name = gpu_name(cfg).lower()
    preset = next((g for g in sorted(GPUS, key=len, reverse=True) if g in name), None)
    return cfg.replace(gpu=preset) if preset and preset != cfg.gpu else cfg


def check_trace(cfg: Config, trace_path: str | Path) -> Trace:
    model = with_context(get_model(cfg.model), cfg.max_model_len)
    return read_trace(trace_path, model)


def replay(
    cfg: Config,
    trace_path: str | Path,
    out_dir: str | Path,
    repeat: int = 1,
    max_seconds: float | None = None,
    warmup: bool = True,
    progress: Callable[[str], None] | None = None,
    fail_after_steps: int | None = None,
    timeline: dict[str, Any] | None = None,
    probe: bool = True,
) -> ReplayResult:
    """Run the trace `repeat` times; write the run folder of the median repeat (by output
    tokens/s) with the spread of every metric over the repeats in `repeat_spread`. On an
    interruption, write the interrupted repeat (complete: false) and re-raise.
    `fail_after_steps` injects an engine error after that many steps (tests); `timeline`:
    write_run's timeline_max_steps / timeline_from_s (which steps timeline.json holds);
    `probe`: serve the host probe (replay.gpu.probe) before each repeat's measured run."""
    trace = check_trace(cfg, trace_path)
    try:
        return _replay(
            cfg,
            trace,
            trace_path,
            Path(out_dir),
            repeat,
            max_seconds,
            warmup,
            progress,
            fail_after_steps,
            timeline,
            probe,
        )
    finally:
        # the engine froze its start-up heap (gc_freeze); leave the process as we found it
        # (a heap left frozen at exit also makes nanobind report Triton's objects as leaks)
        gc.unfreeze()
        stop_tp_workers()  # tensor parallelism: the worker ranks the repeats shared


def _replay(
    cfg: Config,
    trace: Trace,
    trace_path: str | Path,
    out: Path,
    repeat: int,
    max_seconds: float | None,
    warmup: bool,
    progress: Callable[[str], None] | None,
    fail_after_steps: int | None,
    timeline: dict[str, Any] | None,
    probe: bool = True,
) -> ReplayResult:
    deadline = time.monotonic() + max_seconds if max_seconds else None
    t_start = time.monotonic()
    model = None
    done: list[Measured] = []
    for k in range(repeat):
        m, model = _one_repeat(
            cfg, trace, trace_path, out, model, done, deadline, warmup, progress, fail_after_steps,
            timeline, probe,
        )  # fmt: skip
        done.append(m)
        if progress is not None and k < repeat - 1:
            progress(f"repeat {k + 1}/{repeat}: {m.summary['output_tok_per_s'] or 0:.1f} tok/s")
    return _finish(done, cfg, trace_path, out, t_start, timeline)


def replay_interleaved(
    cfgs: dict[str, Config],
    trace_path: str | Path,
    outs: dict[str, Path],
    repeat: int,
    max_seconds: float | None = None,
    warmup: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, ReplayResult]:
    """Each config `repeat` times, the configs taking turns (a, b, a, b, ...), so a host that
    drifts over the call (CPU phases 20 % slower within one device call were seen) moves every
    side alike instead of entering a before/after difference. Each side's folder is written as
    `replay` writes it (its median repeat, with the spread over its repeats); an interrupted
    repeat writes that side's partial folder and re-raises."""
    trace = check_trace(next(iter(cfgs.values())), trace_path)
    deadline = time.monotonic() + max_seconds if max_seconds else None
    t_start = time.monotonic()
    model = None
    done: dict[str, list[Measured]] = {side: [] for side in cfgs}
    try:
        for k in range(repeat):
            for side, cfg in cfgs.items():
                m, model = _one_repeat(
                    cfg, trace, trace_path, outs[side], model, done[side], deadline, warmup,
                    progress, None,
                )  # fmt: skip
                done[side].append(m)
                if progress is not None:
                    tok_s = m.summary["output_tok_per_s"] or 0.0
                    progress(f"round {k + 1}/{repeat} {side}: {tok_s:.1f} tok/s")
        return {s: _finish(done[s], cfgs[s], trace_path, outs[s], t_start) for s in cfgs}
    finally:
        gc.unfreeze()  # as `replay`
        stop_tp_workers()


def _one_repeat(
    cfg: Config,
    trace: Trace,
    trace_path: str | Path,
    out: Path,
    model: Any,
    done: list[Measured],
    deadline: float | None,
    warmup: bool,
    progress: Callable[[str], None] | None,
    fail_after_steps: int | None,
    timeline: dict[str, Any] | None = None,
    probe: bool = True,
) -> tuple[Measured, Any]:
    """One measured run on a fresh engine (the model's weights reused), after the warm-up and
    the host probe. An incomplete run writes its folder (with the spread of the repeats `done`
    before it) and raises."""
    engine, model = new_engine(cfg, model)
    _check_fits(engine, trace, trace_path)
    warm = CompileCounter.for_engine(engine)
    warm_info = None
    if warmup:
        with warm:
            warm_info = warm_up(engine)
    probed = host_probe(engine, cfg) if probe else None  # short: --max-seconds spares it
    ring = event_ring(cfg, trace)
    _fresh_hooks(engine, ring, step_bound(cfg, trace))
    m = _measure(engine, cfg, trace, deadline, progress, fail_after_steps)
    m.event_ring = ring
    m.probe = probed
    if warm_info is not None:
        m.extra["warmup"] = {**warm_info, "jit_compiles": warm.summary()}
    del engine
    if not m.complete:
        _write(m, cfg, trace_path, out, _repeat_extra(done, None) if done else None, timeline)
        err = m.error or RuntimeError("the run ended with requests unfinished")
        with contextlib.suppress(AttributeError):  # for the CLI's message
            err.partial_run = out  # type: ignore[attr-defined]
        raise err
    return m, model


def _finish(
    done: list[Measured],
    cfg: Config,
    trace_path: str | Path,
    out: Path,
    t_start: float,
    timeline: dict[str, Any] | None = None,
) -> ReplayResult:
    """Write the run folder of the median repeat (by output tokens/s), with the spread of every
    metric over the repeats when there are several."""
    best = _median_index(done)
    extra = _repeat_extra(done, best) if len(done) > 1 else None
    summary = _write(done[best], cfg, trace_path, out, extra, timeline)
    return ReplayResult(
        summary, out, time.monotonic() - t_start, [flat_metrics(m.summary) for m in done]
    )


# ---- one repeat ----------------------------------------------------------------------------------
def new_engine(cfg: Config, model: Any) -> tuple[Any, Any]:
    if cfg.device == "cpu":
        # intra-op threads spin-wait: on a shared host a CPU step's time jumps 100x with the
        # load of other processes; the tiny/small models gain nothing from them
        torch.set_num_threads(1)
    # the previous repeat's engine froze its heap (gc_freeze): cycles in it (its KV cache among
    # them) are only freed once unfrozen; the new engine freezes its own start-up heap again
    gc.unfreeze()
    gc.collect()
    if cfg.device == "cuda":
        torch.cuda.empty_cache()  # the previous repeat's KV cache and graphs
    try:
        engine = Engine(cfg, model=model)
    except NotImplementedError as e:
        raise ConfigError(f"the engine cannot run this config: {e}") from None
    except ValueError as e:  # the engine names the config key (e.g. device=cuda without CUDA)
        raise ConfigError(str(e)) from None
    return engine, engine.model


def _check_fits(engine: Any, trace: Trace, trace_path: str | Path) -> None:
    for row in trace.rows():
        r = Request(row.row, row.request_id, row.arrival_s, row.prompt_len, row.output_len)
        why = engine.sched.check_fits(r)
        if why is not None:
            where = f"trace '{trace_path}' row {row.row} request {row.request_id!r}"
            raise TraceError(f"{where}: {why}")


def warm_up(engine: Any) -> dict[str, Any]:
    """Meet the engine's first-call costs before the run: every Triton compile an eager step
    can select (engine.warmup: model forwards over the shape classes, compiled up to 16 at a
    time, then requests over the token-count and row-count classes; CUDA with Triton kernels
    only), then a few synthetic requests together. Synthetic prompts (no prefix id, no ids)
    register no prefix-cache blocks, so no trace request can hit them; every request finishes,
    so every KV block is free again. Returns what was run and how long it took."""
    t0 = time.perf_counter()
    info: dict[str, Any] = {"forward_steps": 0, "request_steps": 0}
    if engine.device.type == "cuda" and getattr(engine.model, "kernels", None) is not None:
        lim = W.Limits.of_engine(engine)
        threads = min(16, os.cpu_count() or 1)
        # every tensor-parallel rank runs the same forwards (Engine.warm_forwards)
        info["forward_steps"], info["forward_compiles"] = engine.warm_forwards(threads)
        reqs = W.request_plan(lim.max_tokens, lim.max_model_len, lim.max_num_seqs, engine.depth)
        info["request_steps"] = W.run_request_plan(engine, reqs, WARMUP_KEY + len(WARMUP_SHAPES))
    for i, (p, o) in enumerate(WARMUP_SHAPES):
        inp = RequestInput(f"warmup-{i}", max(1, min(p, engine.max_model_len - o)), o)
        with contextlib.suppress(ValueError):  # a shape this config cannot hold: skip it
            engine.add_request(inp, key=WARMUP_KEY + i)
    while engine.has_work:
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    info["seconds"] = time.perf_counter() - t0
    return info


def host_probe(engine: Any, cfg: Config) -> Measured:
    """Serve the host probe's requests (replay.gpu.probe) on the warm engine with fresh hooks;
    every request finishes, so every KV block is free again (synthetic prompts register no
    prefix-cache blocks)."""
    inputs = probe_inputs(engine.max_model_len, cfg.max_num_batched_tokens, engine.device.type)
    rows = sum(r.output_len + 1 for r in inputs) + 16  # a step per token + one per prefill
    _fresh_hooks(engine, 256, rows)
    m = _measure(engine, cfg, inputs, None, None, None)
    if not m.complete:
        raise RuntimeError(f"the host probe did not finish: {m.error}") from m.error
    m.extra["probe_requests"] = probe_trace_info(inputs)
    return m


def probe_host(cfg: Config, out: Path) -> dict[str, Any]:
    """`python -m replay probe`: the host probe alone on a fresh, warm engine, written as the run
    folder `out`; returns its summary."""
    try:
        engine, _ = new_engine(cfg, None)
        warm_up(engine)
        return _write_probe(host_probe(engine, cfg), cfg, out)
    finally:
        gc.unfreeze()  # as `replay`
        stop_tp_workers()


def step_bound(cfg: Config, trace: Trace) -> int:
    """Most steps the trace can take: one per output token plus one per prefill chunk (a
    preemption's recompute can add some), capped at MAX_EVENT_RING."""
    chunks = -(-trace.prompt_len.astype("int64") // max(1, cfg.max_num_batched_tokens))
    bound = int(trace.output_len.astype("int64").sum() + chunks.sum()) + 16
    return max(256, min(MAX_EVENT_RING, bound))


def event_ring(cfg: Config, trace: Trace) -> int:
    """CUDA event pairs for the measured hooks: `step_bound`, so no step reads events (the
    hooks read them all after the run). Without gc_freeze the default 256: the 2 x ring event
    objects would stay in the collector's view and lengthen the full collections the run
    measures."""
    if cfg.device != "cuda" or not cfg.gc_freeze:
        return 256
    return step_bound(cfg, trace)


def _fresh_hooks(engine: Any, ring: int, rows: int) -> None:
    """New hooks for the measured run (the warm-up's rows gone), sized for `rows` steps so
    that they do not grow during it; with gc_freeze, the objects made since the engine froze
    its heap (the warm-up's, the hooks' events) join it."""
    engine.hooks = StepHooks(engine.device, capacity=rows, ring=ring)
    if engine.cfg.gc_freeze:
        gc.collect()
        gc.freeze()


def _measure(
    engine: Any,
    cfg: Config,
    trace: Trace | list[RequestInput],
    deadline: float | None,
    progress: Callable[[str], None] | None,
    fail_after_steps: int | None,
) -> Measured:
    first_state = len(engine.states)
    preempted_before = engine.sched.num_preemptions  # the warm-up's
    steps = 0
    last_note = time.monotonic()

    def on_step(eng: Any) -> None:
        nonlocal steps, last_note
        steps += 1
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise ReplayTimeout("--max-seconds ran out")
        if fail_after_steps is not None and steps >= fail_after_steps:
            raise RuntimeError(f"injected engine error after {steps} steps")
        if progress is not None and now - last_note > 0.5:
            last_note = now
            done = sum(1 for s in eng.states[first_state:] if s.finish_ns >= 0)
            progress(f"step {steps:,}, {done}/{len(trace)} requests done")

    error: BaseException | None = None
    t0 = time.monotonic()
    measured = CompileCounter.for_engine(engine)
    with _alarm(deadline), measured:
        try:
            engine.run(trace, on_step=on_step)
            step_trace = engine.trace
        except (KeyboardInterrupt, Exception) as e:
            error = e
            step_trace = _finish_after_error(engine)
    wall = time.monotonic() - t0
    outputs = [s.result() for s in engine.states[first_state:]]
    outputs.sort(key=lambda o: o.arrival_ns)  # recorder rows in arrival order, like the sim
    preempted = engine.sched.num_preemptions - preempted_before
    reference, ref_error = None, None
    if error is None:
        try:  # the run is measured: a reference that cannot be taken must not lose it
            reference = segment_reference(engine, step_trace)
        except Exception as e:
            ref_error = f"{type(e).__name__}: {e}"
    conv = to_recorder(step_trace, outputs, reference)
    complete = error is None and conv.unfinished == 0 and len(outputs) == len(trace)
    extra = _extra(engine, cfg, conv, wall, error, len(outputs), len(trace))
    extra["engine"]["preemptions"] = preempted
    if ref_error is not None:  # kernel_busy left those segments' waits in the busy time
        extra["segment_reference_error"] = ref_error
    extra["jit_compiles"] = measured.summary()
    # how GPU event times were put on the host clock (engine.hooks: two anchors, their rate)
    extra["gpu_clock"] = dict(getattr(step_trace, "clock", {}) or {})
    if getattr(engine, "tp", None) is not None:
        extra["tensor_parallel"] = _tp_extra(engine, step_trace)
    return Measured(conv.recorder, extra, _summarize(conv.recorder, cfg), complete, error,
                    rank_ns=step_trace.rank_ns, t0_ns=step_trace.t0_ns)  # fmt: skip


def segment_reference(engine: Any, step_trace: Any) -> SegmentReference | None:
    """After a CUDA run (one GPU) in which some step segment never ran clean (the host always
    behind the GPU drafter): that segment's kernel time at the run's sizes, timed behind a spin
    on the same engine (replay.gpu.segref; its requests are dropped). None where every segment
    has clean steps."""
    if engine.device.type != "cuda" or getattr(engine, "tp", None) is not None:
        return None
    need = segments_without_clean(step_trace)
    if not need:
        return None
    steps = np.logical_or.reduce(list(need.values()))
    shapes = [sh for sh, x in zip(step_trace.shapes, steps.tolist()) if x]
    rows, ctx = segref.grid_points(
        np.array([sh.num_reqs for sh in shapes]), np.array([sh.max_kv_tokens for sh in shapes])
    )
    return segref.measure(engine, rows, ctx)


def _tp_extra(engine: Any, step_trace: Any) -> dict[str, Any]:
    """Tensor parallelism: the ranks' devices and the step broadcast's host time (rank 0's
    `broadcast` interval, engine.hooks; a column of the run's steps only where
    bubblesim.core.phases.CPU_PHASES has it)."""
    size = engine.tp.size
    b = step_trace.broadcast_ns
    us = (b[:, 1] - b[:, 0])[b[:, 0] >= 0] / 1e3
    cuda = engine.device.type == "cuda"
    return {
        "size": size,
        "devices": [torch.cuda.get_device_name(r) if cuda else "cpu" for r in range(size)],
        "broadcast_steps": int(len(us)),
        "broadcast_us_p50": float(np.median(us)) if len(us) else None,
        "broadcast_us_mean": float(us.mean()) if len(us) else None,
        "broadcast_s_total": float(us.sum() / 1e6),
        # worker-rank launch rows in ranks.parquet (replay.analysis.ranks)
        "rank_launches": len(step_trace.rank_ns),
    }


def _finish_after_error(engine: Any) -> Any:
    """The hooks' record after an interruption: `Engine.run` finishes the hooks on its way out
    (reading what the device still gives; a step cut short keeps no GPU interval)."""
    trace = getattr(engine, "trace", None)
    return trace if trace is not None else engine.finish()


class _alarm:
    """SIGALRM shortly after the deadline, for waits where no step runs (an idle gap in a
    realtime trace); the per-step check normally stops the run first."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.armed = False

    def __enter__(self) -> None:
        if self.deadline is None or not hasattr(signal, "SIGALRM"):
            return
        try:
            self.prev = signal.signal(signal.SIGALRM, self._fire)
        except ValueError:  # not the main thread
            return
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, max(0.01, self.deadline - time.monotonic() + 0.25))

    def __exit__(self, *exc: object) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.prev)

    @staticmethod
    def _fire(signum: int, frame: object) -> None:
        raise ReplayTimeout("--max-seconds ran out")


def _extra(
    engine: Any,
    cfg: Config,
    conv: Any,
    wall: float,
    error: BaseException | None,
    arrived: int,
    trace_rows: int,
) -> dict[str, Any]:
    return {
        "wall_s": wall,
        "engine": {
            "num_kv_blocks": engine.num_kv_blocks,
            "graph_buckets": list(engine.graphs.buckets) if engine.graphs is not None else [],
            "preemptions": engine.sched.num_preemptions,
        },
        "versions": versions(),
        "requests_arrived": arrived,
        "trace_rows": trace_rows,
        "unfinished_requests": conv.unfinished,
        "gpu_intervals_dropped": conv.dropped_gpu_rows,
        "gpu_start_moved_to_launch": {
            "steps": int((conv.gpu_start_moved_ns > 0).sum()),
            "total_s": float(conv.gpu_start_moved_ns.sum() / 1e9),
        },
        # GPU waits for the host inside step intervals, taken out of the busy time
        # (replay.gpu.measure.kernel_busy): the simulator's passes are kernels only
        "gpu_waits_in_steps": conv.waits,
        "interrupted": None if error is None else f"{type(error).__name__}: {error}",
        "device": cfg.device,
    }


def versions() -> dict[str, str | None]:
    """The software a measurement ran on (a run's summary, a sweep's metadata)."""
    python = sys.version.split()[0]
    return {"python": python, "torch": torch.__version__, "triton": _version("triton")}


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


def _summarize(rec: Any, cfg: Config) -> dict[str, Any]:
    """The summary numbers write_run will compute (same freeze and bubble accounting), without
    writing: a repeat's metrics for the spread."""
    frozen = rec.freeze()
    return build_summary(
        frozen,
        account_bubbles(frozen),
        config=cfg.to_dict(),
        trace={},
        source={},
        complete=True,
        timeline={},
    )


def _write(
    m: Measured,
    cfg: Config,
    trace_path: str | Path,
    out: Path,
    repeat_extra: dict[str, Any] | None,
    timeline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    extra = dict(m.extra)
    harvests = (m.summary.get("num_steps") or 0) > m.event_ring  # rows read inside the run
    cost = hook_overhead(cfg.device, harvests=harvests)
    extra["instrumentation"] = {**overhead_summary(cost, m.summary), "event_ring": m.event_ring}
    if m.probe is not None:
        extra["host_probe"] = {
            "folder": PROBE_DIR,
            "steps": m.probe.summary.get("num_steps"),
            "wall_s": m.probe.extra.get("wall_s"),
        }
    summary_extra: dict[str, Any] = {"replay": extra, **(repeat_extra or {})}
    summary = write_run(
        out,
        m.recorder,
        config=as_run(cfg),
        trace=trace_info(trace_path),
        source={"kind": "replay", "gpu": gpu_name(cfg)},
        complete=m.complete,
        extra=summary_extra,
        **(timeline or {}),
    )
    write_ranks(out, m.rank_ns, m.t0_ns)  # beside steps.parquet, after the swap; none if empty
    if m.probe is not None:  # inside the run's folder, after it: the run's swap replaces all
        _write_probe(m.probe, cfg, out / PROBE_DIR)
    return summary


def _write_probe(probe: Measured, cfg: Config, out: Path) -> dict[str, Any]:
    """A host probe's run folder (its trace: the probe's request list, replay.gpu.probe)."""
    return write_run(
        out,
        probe.recorder,
        config=as_run(cfg),
        trace=probe.extra["probe_requests"],
        source={"kind": "replay", "gpu": gpu_name(cfg)},
        extra={"replay": probe.extra},
    )


def _median_index(done: list[Measured]) -> int:
    vals = [m.summary.get("output_tok_per_s") or 0.0 for m in done]
    order = sorted(range(len(vals)), key=lambda i: vals[i])
    return order[(len(order) - 1) // 2]


def _repeat_extra(done: list[Measured], chosen: int | None) -> dict[str, Any]:
    flats = [flat_metrics(m.summary) for m in done]
    names = list(flats[0]) if flats else []
    return {
        "repeat_spread": {n: spread([f[n] for f in flats]) for n in names},
        "repeats": {
            "count": len(done),
            "chosen": chosen,
            "output_tok_per_s": [f["output_tok_per_s"] for f in flats],
            "num_kv_blocks": [m.extra["engine"]["num_kv_blocks"] for m in done],
            "jit_compiles": [m.extra["jit_compiles"]["count"] for m in done],
            "metrics": flats,
        },
    }
