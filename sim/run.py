"""A predicted run: trace + config -> SimPy model of the engine -> run folder (Contract 3)."""

from __future__ import annotations

import gc as pygc
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast, overload

import numpy as np

from bubblesim.core.atomic import temp_dir
from bubblesim.core.config import Config
from bubblesim.core.gpus import get_gpu
from bubblesim.core.models import get_model, with_context
from bubblesim.core.policy import Scheduler
from bubblesim.core.policy.sizing import kv_blocks_for_gpu, scheduler_config
from bubblesim.core.request import Request
from bubblesim.core.runfmt import Recording, RunRecorder, trace_info, write_run
from bubblesim.core.runfmt.timeline import DEFAULT_MAX_STEPS
from bubblesim.core.scenario import Scenario
from bubblesim.core.shape import SHAPE_FIELDS
from bubblesim.core.tpfit import fit_error
from bubblesim.core.trace import Trace, TraceError, read_trace
from sim.acceptance import AcceptanceModel
from sim.cost import CostModel, load_cost_model
from sim.cost.envelope import outside_share
from sim.gcmodel import GCModel
from sim.loop import SimLoop
from sim.overload import overload_of
from sim.progress import LoopProgress, Progress

# Per-draft acceptance when a trace has neither token ids nor accept_rate: EAGLE-3 on
# Llama-3.1-8B averages ~0.7 at the first position (ENGINE-NOTES §5); prompt lookup less.
DEFAULT_ACCEPT_RATE = 0.5


@dataclass
class SimResult:
    summary: dict[str, Any]
    recorder: RunRecorder
    wall_s: float
    num_blocks: int


def build_requests(trace: Trace, arrival_mode: str = "realtime") -> list[Request]:
    """Requests in arrival order; `Request.index` is the recorder row (arrival rank).
    `arrival_mode` 'asap' queues every request at time 0, in the trace's arrival order, as
    `replay run --set arrival=asap` does: throughput is then the engine's, not the trace's."""
    order = trace.arrival_order()
    rows = order.tolist()
    rids = trace.request_id[order]
    request_ids = rids.tolist() if rids.dtype != object else [_scalar(x) for x in rids]
    if arrival_mode == "asap":
        arrival = [0.0] * len(rows)
    else:
        arrival = trace.arrival_s[order].tolist()
    prompt = trace.prompt_len[order].tolist()
    output = trace.output_len[order].tolist()
    hist = trace.needs_history[order].tolist() if trace.needs_history is not None else None
    pg, pk, pl = trace.prefix_group, trace.prefix_keys, trace.prefix_len
    ids = trace.prompt_ids
    if hist is None and pg is None and ids is None:  # lengths only (big traces): positional
        cols = zip(request_ids, arrival, prompt, output)
        return [Request(i, rid, a, p, o) for i, (rid, a, p, o) in enumerate(cols)]
    out = []
    for i, row in enumerate(rows):
        prefix_id = None
        prefix_len = 0
        if pg is not None and pk is not None and pl is not None and pg[row] >= 0:
            prefix_id = _scalar(pk[pg[row]])
            prefix_len = int(pl[row])
        out.append(
            Request(
                index=i,
                request_id=request_ids[i],
                arrival_s=arrival[i],
                prompt_len=prompt[i],
                output_len=output[i],
                needs_history=bool(hist[i]) if hist is not None else False,
                prefix_id=prefix_id,
                prefix_len=prefix_len,
                prompt_ids=ids[row].tolist() if ids is not None else None,
            )
        )
    return out


ROWS_CHUNK = 4096  # RequestRows: rows converted to Python values at a time


class RequestRows(Sequence[Request]):
    """A lengths-only trace's requests in arrival order, each `Request` made when first
    indexed: the loop reads them forward (`SimLoop.take_arrivals`), so a run of a million
    requests holds only those in the engine, not a million objects. The last one made is
    kept, so the request the loop peeks at is the one it submits. Each is the Request that
    `build_requests` makes for that row."""

    def __init__(self, trace: Trace, arrival_mode: str = "realtime") -> None:
        order = trace.arrival_order()
        self.request_id = trace.request_id[order]
        self.arrival_s = np.zeros(len(order)) if arrival_mode == "asap" else trace.arrival_s[order]
        self.prompt_len = trace.prompt_len[order]
        self.output_len = trace.output_len[order]
        self._n = len(self.arrival_s)
        self._last: tuple[int, Request] | None = None
        # rows [chunk_start, chunk_start + CHUNK) as Python values (one tolist per column per
        # chunk instead of four numpy-scalar conversions per request; memory stays bounded)
        self._chunk_start = 0
        self._chunk: tuple[list, list, list, list] = ([], [], [], [])

    @staticmethod
    def fits(trace: Trace) -> bool:
        """Whether the trace has lengths only (what RequestRows makes, build_requests would)."""
        return (
            trace.needs_history is None
            and trace.prefix_group is None
            and (trace.prompt_ids is None)
        )

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Request: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Request]: ...
    def __getitem__(self, i: int | slice) -> Request | Sequence[Request]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += self._n
        if self._last is not None and self._last[0] == i:
            return self._last[1]
        if not 0 <= i < self._n:
            raise IndexError(f"request row {i} of {len(self)}")
        at = i - self._chunk_start
        if not 0 <= at < len(self._chunk[1]):  # not in the loaded rows (none at first)
            self._load_chunk(i)
            at = 0
        ids, arrival, prompt, output = self._chunk
        req = Request(i, ids[at], float(arrival[at]), int(prompt[at]), int(output[at]))
        self._last = (i, req)
        return req

    def _load_chunk(self, i: int) -> None:
        end = i + ROWS_CHUNK
        cols = (self.request_id, self.arrival_s, self.prompt_len, self.output_len)
        ids, arrival, prompt, output = (c[i:end].tolist() for c in cols)
        if self.request_id.dtype == object:  # tolist leaves an object column's items as they are
            ids = [_scalar(x) for x in ids]
        self._chunk = (ids, arrival, prompt, output)
        self._chunk_start = i

    def _row(self, i: int) -> Request:
        """`self[i]`, made from row i alone: for reads out of order (a chunk each would be
        converted for one row), leaving the loaded chunk and the last request as they are."""
        rid = _scalar(self.request_id[i])
        arrival, prompt, output = self.arrival_s[i], self.prompt_len[i], self.output_len[i]
        return Request(i, rid, float(arrival), int(prompt), int(output))

    def first_unfit(self, sched: Scheduler) -> tuple[Request, str] | None:
        """The first request (arrival order) that `sched.check_fits` refuses, and why.
        check_fits reads only prompt_len + output_len, so each distinct total is checked once,
        on the first request that has it."""
        total = self.prompt_len.astype(np.int64) + self.output_len
        totals, first = np.unique(total, return_index=True)
        bad = []
        for row in first.tolist():  # in order of totals: rows far apart
            why = sched.check_fits(self._row(row))
            if why is not None:
                bad.append((row, why))
        if not bad:
            return None
        row, why = min(bad)
        return self._row(row), why


def _scalar(x: Any) -> Any:
    """A numpy scalar as its Python value; anything else as is."""
    return x.item() if hasattr(x, "item") else x


def acceptance_for(cfg: Config, trace: Trace) -> AcceptanceModel:
    order = trace.arrival_order()
    token_ids = None
    if trace.prompt_ids is not None and trace.output_ids is not None:
        p, o = trace.prompt_ids, trace.output_ids
        token_ids = [(p[r].tolist(), o[r].tolist()) for r in order.tolist()]
    rate = trace.accept_rate[order] if trace.accept_rate is not None else None
    return AcceptanceModel(cfg.spec, cfg.seed, token_ids, rate, DEFAULT_ACCEPT_RATE)


def envelope_share(envelope: dict[str, Any], rec: Recording) -> dict[str, Any]:
    """Per batch kind the profile's envelope covers: the share of the run's steps, and of their
    GPU time, outside it (sim.cost.envelope), from the recorded step columns."""
    cols = {f: rec.shape[:, i] for i, f in enumerate(SHAPE_FIELDS)}
    gpu_ms = (rec.gpu_end - rec.gpu_start) * 1e3
    return outside_share(envelope, cols, np.nan_to_num(gpu_ms))


def simulate(
    cfg: Config,
    trace_path: str | Path,
    out_dir: str | Path | None = None,
    progress: Progress | None = None,
    cost: CostModel | None = None,
    timeline_steps: int | None = DEFAULT_MAX_STEPS,
    timeline_from_s: float = 0.0,
    steps: bool = True,
    scenario: Scenario | None = None,
) -> SimResult:
    """Run the simulator; write the run folder when `out_dir` is given (its timeline.json:
    `timeline_steps` steps, None for all, from the first step at or after `timeline_from_s`;
    without step records when `steps` is False: `write_run`). `progress` counts simulated
    seconds out of the trace's arrival span. A `scenario` the config came from is recorded in
    the summary (`scenario`: the trace and the keys it set).

    With `out_dir`, the step records go to a spill folder beside it as the run goes (bounded
    memory: bubblesim.core.runfmt.spill), removed once they are mapped (before the folder is
    written) or on error; a killed run's is swept by the next write there (core.atomic)."""
    cost = cost or load_cost_model(cfg)
    spill = None
    if out_dir is not None:
        Path(out_dir).parent.mkdir(parents=True, exist_ok=True)
        spill = temp_dir(Path(out_dir))
    try:
        return _simulate(
            cfg, trace_path, out_dir, progress, cost, timeline_steps, timeline_from_s, steps,
            scenario, spill,
        )  # fmt: skip
    finally:
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)


def _simulate(
    cfg: Config,
    trace_path: str | Path,
    out_dir: str | Path | None,
    progress: Progress | None,
    cost: CostModel,
    timeline_steps: int | None,
    timeline_from_s: float,
    steps: bool,
    scenario: Scenario | None,
    spill: Path | None,
) -> SimResult:
    rec, extra, wall_s, num_blocks = _run_loop(cfg, trace_path, progress, cost, spill)
    pygc.collect()  # the loop's objects hold cycles (loop <-> fast path, hooks): gone now
    if scenario is not None:
        extra["scenario"] = {"trace": scenario.trace, "keys": scenario.flat()}
    # the recorder's own columns become the Recording's: the folder is written with one copy
    frozen = rec.freeze(release=True) if out_dir is not None or cost.envelope else None
    if spill is not None:  # its files stay readable through the Recording's maps until it dies
        shutil.rmtree(spill, ignore_errors=True)
    if frozen is not None and cost.envelope:
        extra["cost_envelope"] = envelope_share(cost.envelope, frozen)
    summary: dict[str, Any]
    if out_dir is not None:
        assert frozen is not None
        if progress is not None:
            progress.phase("writing run folder")
        extra["overload"] = overload_of(frozen.arrival, frozen.first_token, frozen.finish)
        summary = write_run(
            out_dir,
            frozen,
            config=cfg,
            trace=trace_info(trace_path),
            source={"kind": "sim"},
            extra=extra,
            timeline_max_steps=timeline_steps,
            timeline_from_s=timeline_from_s,
            steps=steps,
        )
    else:
        summary = {"extra": extra}
    return SimResult(summary, rec, wall_s, num_blocks)


def _run_loop(
    cfg: Config,
    trace_path: str | Path,
    progress: Progress | None,
    cost: CostModel,
    spill: Path | None,
) -> tuple[RunRecorder, dict[str, Any], float, int]:
    """The step loop over the trace: (recorder, the summary's `sim` facts, loop wall seconds,
    KV blocks). The trace, the requests and the model's state are dropped on return, before
    the run folder is written."""
    model = with_context(get_model(cfg.model), cfg.max_model_len)
    trace = read_trace(trace_path, model)
    gpu = get_gpu(cfg.gpu)
    why = fit_error(cfg, model, gpu)
    if why is not None:
        raise TraceError(why)
    num_blocks = kv_blocks_for_gpu(cfg, model, gpu.memory_bytes)  # per replica (and per GPU)
    sched = Scheduler(scheduler_config(cfg, model, num_blocks))
    requests: Sequence[Request]
    if RequestRows.fits(trace):  # made as the loop reaches them: bounded memory
        rows = RequestRows(trace, cfg.arrival)
        unfit = rows.first_unfit(sched)
        if unfit is not None:
            raise TraceError(f"trace '{trace_path}' request {unfit[0].request_id!r}: {unfit[1]}")
        ids = rows.request_id
        request_ids = ids.tolist() if ids.dtype != object else [_scalar(x) for x in ids]
        arrivals: list[float] = rows.arrival_s.tolist()
        requests = rows
    else:
        requests = build_requests(trace, cfg.arrival)
        for r in requests:
            why = sched.check_fits(r)
            if why is not None:
                raise TraceError(f"trace '{trace_path}' request {r.request_id!r}: {why}")
        request_ids = [r.request_id for r in requests]
        arrivals = [r.arrival_s for r in requests]
    rec = RunRecorder(spill_dir=spill)
    rec.add_requests(request_ids, arrivals)
    del request_ids, arrivals
    gc = GCModel(cfg.gc, cfg.gc_freeze, cost.gc_pause_ms)
    accept = acceptance_for(cfg, trace)
    hook = None
    if progress is not None:
        progress.total = requests[-1].arrival_s if requests else 0.0
        progress.unit = " s simulated"
        hook = LoopProgress(progress)
    # the loop reads `requests` forward by index and takes its len (RequestRows)
    loop = SimLoop(cfg, sched, cost, rec, cast(list[Request], requests), accept, gc, hook)
    if hook is not None:
        hook.attach(loop)
    t0 = time.perf_counter()
    loop.run()
    wall_s = time.perf_counter() - t0
    if hook is not None:
        hook.loop = None  # the caller's progress bar outlives the loop
    extra: dict[str, Any] = {
        "sim": {
            "wall_s": wall_s,
            "num_kv_blocks": num_blocks,
            "preemptions": sched.num_preemptions,
            "gc_collections": gc.num_collections,
            "cost_profile": cost.profile.get("source", "defaults")
            if isinstance(cost.profile, dict)
            else "defaults",
        }
    }
    return rec, extra, wall_s, num_blocks
