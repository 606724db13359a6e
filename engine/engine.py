"""The engine: the step loop around the shared scheduling policy.

One loop iteration (`step`), mirrored phase for phase by `sim.loop`:

    schedule -> prepare_inputs -> launch -> sample -> draft     while < depth batches in flight
    [sync on the oldest batch] -> process_outputs               once depth are in flight

State advances when a batch is launched (`Scheduler.schedule`) and results apply when it completes
(`Scheduler.complete`), so `batches_in_flight` (depth) is a property of this loop only: depth 1
is synchronous; with 2 or 3 the CPU schedules and launches batch j+1 before waiting for batch j.
It can, because nothing it needs to launch lives only on the GPU: a decode's input id is read on
the device from the slot's last sampled token (engine.sampler), and the CPU output lists hold -1
placeholders until results arrive. The one deliberate host wait is `OutputRing.wait` (recorded
as `sync`); every other host<->device transfer is an asynchronous copy from pinned memory.

Speculative decoding (engine.spec.decoder) keeps this shape: decodes feed k drafts and get k + 1
verified tokens; ngram-gpu proposes in `draft` on the device, ngram-cpu waits there for the
step's tokens (so it runs with one batch in flight); with seed 5 off the CPU also waits for the
in-flight steps' accepted counts before `prepare_inputs` (both waits recorded as `sync`).

Tensor parallelism (config key `tensor_parallel_size` > 1, engine.tp): this engine is rank 0;
it starts the other ranks with its model (or uses those of the model it is given), and each
of them builds the same Engine from this config. Between `prepare_inputs` and `launch` rank 0
sends the step (`broadcast`: a fixed-size header through shared memory, with new slots' sampler
state when there are any and the host input arrays in the same ring slot; a step whose arrays
do not fit a slot sends the uploaded input buffers by a device broadcast); each worker runs the
same device work (`serve_step`): its own upload of those arrays, input finishing, the forward
(or the same CUDA graph, all-reduces inside) and sampling from the same gathered logits, so its
per-slot sampler state (the next decode's input ids) stays identical to rank 0's. Only rank 0
schedules, reads tokens and syncs; workers never wait for their device. `close()` ends the
workers' engine (and the workers, when this engine started them).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bubblesim.core import phases as P
from bubblesim.core.config import Config
from bubblesim.core.graph_buckets import mixed_graph_tokens
from bubblesim.core.models import PRESETS, ModelSpec, get_model
from bubblesim.core.policy import ScheduledBatch, Scheduler
from bubblesim.core.policy.sizing import kv_blocks_from_free_bytes, scheduler_config
from bubblesim.core.request import Status
from bubblesim.core.shape import BatchShape
from bubblesim.core.trace import Trace
from engine.attention import AttentionMetadata
from engine.graphs import DecodeGraphs
from engine.hooks import DRAFT_BEGIN, FORWARD_BEGIN, FORWARD_END, StepHooks, StepTrace
from engine.inputs import InputBuffers, StepInputs
from engine.mixed_graphs import MixedGraphs
from engine.model import LlamaModel, allocate_kv_cache, engine_dtype, kv_cache_bytes_per_block
from engine.outputs import OutputRing, first_placeholder, update_async_output_token_ids
from engine.requests import (
    RequestInput,
    RequestOutput,
    RequestState,
    SlotPool,
    inputs_from_trace,
    make_state,
)
from engine.sampler import Sampler, SampleRows
from engine.spec.decoder import SpecDecoder
from engine.spec.inputs import SpecInputBuffers
from engine.tp.comm import (
    OP_END_ENGINE,
    OP_ENGINE,
    OP_RANK_TIMES,
    OP_STEP,
    OP_WARM_FORWARDS,
    RANK_TIMES_GATHER,
    RANK_TIMES_START,
    Comm,
    check_symmetric,
)
from engine.tp.ranktimes import RankTimes, empty_table
from engine.tp.watchdog import ENGINE_S, SHUTDOWN_S, deadline

CPU_KV_BYTES = 64 << 20  # the KV budget on CPU, where free memory says little
_now = time.perf_counter_ns


@dataclass(slots=True)
class InFlight:
    """A launched batch whose results have not been applied yet."""

    batch: ScheduledBatch
    row: int  # hooks row
    ring: int  # OutputRing slot
    num_gen: int  # tokens it samples (one per generating entry, in entry order)
    hist_rows: dict[int, int] | None  # Request.index -> generating row, needs-history only


def build_model(cfg: Config, max_model_len: int) -> LlamaModel:
    """Random weights for a preset (seeded), or a checkpoint folder's weights. Tensor
    parallelism: rank 0's shard, the other ranks started with theirs (engine.tp.workers)."""
    if cfg.tensor_parallel_size > 1:
        from engine.tp.workers import start

        return start(cfg, max_model_len, Engine)  # the workers build their engines with it
    dtype, device = engine_dtype(cfg), torch.device(cfg.device)
    if cfg.model not in PRESETS:  # a checkpoint folder
        from engine.loader import load_checkpoint

        return load_checkpoint(cfg.model, dtype, device, max_positions=max_model_len)
    spec = PRESETS[cfg.model]
    return LlamaModel(spec, dtype, device, max_positions=max_model_len).init_random(cfg.seed)


class Engine:
    def __init__(self, cfg: Config, model: LlamaModel | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("config key 'device': cuda, but no CUDA device is available")
        self.max_model_len = cfg.max_model_len or get_model(cfg.model).max_context
        tp = cfg.tensor_parallel_size
        if tp > 1 and cfg.spec.enabled:
            raise NotImplementedError(
                "config key 'tensor_parallel_size': speculative decoding is not built for "
                "tensor parallelism"
            )
        if tp > 1 and cfg.tp_allreduce in ("oneshot", "fused"):
            check_symmetric(None if model is None else model.comm)
        self._owns_tp = model is None and tp > 1  # started the workers: close() stops them
        self.model = model if model is not None else build_model(cfg, self.max_model_len)
        self.tp: Comm | None = self.model.comm  # None without tensor parallelism
        if (1 if self.tp is None else self.tp.size) != tp:
            raise ValueError(
                f"config key 'tensor_parallel_size': {tp}, but the given model is built for "
                f"{1 if self.tp is None else self.tp.size}"
            )
        if self.tp is not None:
            self.device = self.model.device  # this rank's device
            if self.tp.is_driver and self.tp.workers is None:
                raise ValueError(
                    "config key 'tensor_parallel_size': the given model's worker ranks were "
                    "stopped (Engine.close or engine.tp.workers.stop_all); build a new model"
                )
            if self.tp.is_driver:  # the workers build the same engine, collective for collective
                self.tp.send_header(OP_ENGINE)
                self.tp.send_object(cfg)
                self.tp.engines.add(self)  # its graphs go before the group (Comm.close)
        self._closed = False
        self._inits: list[tuple[int, tuple | None]] = []  # new slots' sampler state to send
        # rank 0's broadcast in parts (new slots' payload built, header, payload and host input
        # arrays written to the ring, device broadcast enqueued when the arrays did not fit),
        # ns per step, when a bench sets it to a list; None: not recorded
        self.broadcast_parts: list[tuple[int, int, int]] | None = None
        # per step, 1 when its host input arrays rode in the ring (else the device broadcast)
        self.broadcast_ring: list[int] | None = None
        # a worker rank's own launch times (engine.tp.ranktimes), on between rank 0's
        # Engine.start and Engine.finish
        self.rank_times = None if self.tp is None or self.tp.is_driver else RankTimes(self.tp.rank)
        try:
            if self.tp is None:
                self._build(cfg)
            else:  # every rank's collectives must meet: a hang is one error naming the step
                step = f"rank {self.tp.rank}: build the engine (every rank)"
                with deadline(step, ENGINE_S, self.tp.on_expiry, self.tp.peers_alive):
                    self._build(cfg)
        except BaseException:
            if self._owns_tp:  # the workers it started would outlive the failed engine
                self.model.comm.close()
            raise

    def _build(self, cfg: Config) -> None:
        """The constructor after the model: what every tensor-parallel rank builds alike."""
        self.spec: ModelSpec = self.model.spec
        if self.tp is not None:  # before any graph captures the model's all-reduces
            self.tp.use_allreduce(cfg.tp_allreduce, self.model.dtype)
        self.depth = cfg.depth  # 1 with ngram-cpu (synchronous, as vLLM), else batches_in_flight
        n = cfg.max_num_seqs
        max_tokens = max(cfg.max_num_batched_tokens, n)
        # mixed-step graphs (plain decoding only): buffers hold the largest token bucket
        mixed = cfg.cuda_graphs_mixed and not cfg.spec.enabled
        buffer_tokens = mixed_graph_tokens(max_tokens) if mixed else max_tokens
        max_blocks = -(-self.max_model_len // cfg.block_size)
        self.sd: SpecDecoder | None = None  # speculative decoding (engine.spec)
        self.q = 1  # logits rows per generating request: 1, or k + 1 with drafts
        last_sampled = None
        if cfg.spec.enabled:
            self.sd = SpecDecoder(cfg, self.depth, self.max_model_len, self.device)
            self.q = cfg.spec.k + 1
            last_sampled = self.sd.last_sampled
        vocab = self.spec.vocab_size
        self.sampler = Sampler(cfg.sampling, cfg.seed, n, vocab, self.device, last_sampled)
        if self.sd is not None:
            self.inputs = SpecInputBuffers(
                self.depth, n, buffer_tokens, max_blocks, cfg.block_size, self.sd.token_source,
                cfg.spec.k,
            )  # fmt: skip
        else:
            self.inputs = InputBuffers(
                self.depth, n, buffer_tokens, max_blocks, cfg.block_size, self.sampler.last_sampled
            )
        self.outputs = OutputRing(self.depth, n * self.q, self.device)
        self.num_kv_blocks = self._kv_blocks()
        self.kv_cache = allocate_kv_cache(  # this rank's KV heads
            self.model.local, self.num_kv_blocks, cfg.block_size, self.model.dtype, self.device
        )
        self.sched = Scheduler(scheduler_config(cfg, self.spec, self.num_kv_blocks))
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None  # on CPU: the same padded steps, run eagerly
        pool = None
        if mixed:
            self.mixed = MixedGraphs(
                self.model, self.kv_cache, self.inputs, self.sampler, max_tokens,
                self.max_model_len,
            )  # fmt: skip
            if self.device.type == "cuda":
                self.mixed.capture(mode=self._capture_mode)  # first: sizes the shared pool
                pool = self.mixed.pool
        if cfg.cuda_graphs and self.device.type == "cuda":
            sampler = self.sampler if self.sd is None else None  # graphs sample w/o drafts
            self.graphs = DecodeGraphs(
                self.model, self.kv_cache, self.inputs, n, self.max_model_len, self.q, sampler
            )
            self.graphs.capture(pool, self._capture_mode)
        self.hooks = StepHooks(self.device)
        self.states: list[RequestState] = []
        self.slots = SlotPool(n)
        self.inflight: deque[InFlight] = deque()
        self.reverse_scan = cfg.reverse_placeholder_scan
        if cfg.gc_freeze:  # start-up objects leave the collector's view (vLLM freeze_gc_heap)
            gc.collect()
            gc.freeze()

    @property
    def _capture_mode(self) -> str:
        """CUDA graph capture mode: "thread_local" with tensor parallelism, so that the NCCL
        watchdog thread's event queries do not invalidate a capture; else torch's default."""
        return "global" if self.tp is None else "thread_local"

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> bool:
        """One loop iteration. Returns False when there was nothing to launch or apply."""
        launched = len(self.inflight) < self.depth and self.sched.has_unfinished and self._launch()
        if self.inflight and (not launched or len(self.inflight) >= self.depth):
            self._complete(self.inflight.popleft())
            return True
        return launched

    def _launch(self) -> bool:
        h = self.hooks
        h.begin(P.SCHEDULE)
        batch = self.sched.schedule()
        if batch is None:
            h.cancel()
            return False
        row = h.new_row(batch.shape)
        h.end(row)
        self.inflight.append(self.launch_batch(batch, row))
        return True

    def launch_batch(self, batch: ScheduledBatch, row: int) -> InFlight:
        """Everything of a step after `schedule`, on hooks row `row`: prepare_inputs -> launch ->
        sample -> draft. The step's GPU interval runs from hooks.gpu_begin in `_prepare` to
        hooks.gpu_end in `_sample` (or in `_draft`, ngram-gpu). The loop appends the returned
        batch to `inflight`; replay.gpu.shapes launches synthetic batches here and never does."""
        if self._closed:
            raise RuntimeError("this tensor-parallel engine was closed (Engine.close)")
        h = self.hooks
        shift = self._wait_for_accepted_counts(row)  # spec with seed 5 off only
        h.begin(P.PREPARE_INPUTS)
        step = self._prepare(batch, row, shift)
        h.end(row)
        if self.tp is not None:
            h.begin_broadcast()
            self._broadcast(step, row)
            h.end_broadcast(row)
        h.begin(P.LAUNCH)
        h.graphed[row] = 1 if step.bucket else 0
        if self.tp is not None:  # `send`'s device work, after the broadcast
            self.inputs.apply(step, finish=not self._graph_samples(step))
        h.mark(row, FORWARD_BEGIN)
        logits = self.forward(step)
        h.mark(row, FORWARD_END)
        h.end(row)
        h.begin(P.SAMPLE)
        flight = self._sample(batch, row, step, logits)
        h.end(row)
        self._draft(flight, step)
        return flight

    def _complete(self, flight: InFlight) -> None:
        h = self.hooks
        if not self.outputs.ready(flight.ring):
            t0 = h.sync_begin()
            self.outputs.wait(flight.ring)
            h.sync_end(flight.row, t0)
        h.begin(P.PROCESS_OUTPUTS)
        self._process_outputs(flight)
        h.end(flight.row)

    # ---- phases ------------------------------------------------------------------------------
    def _wait_for_accepted_counts(self, row: int):
        """Seed 5 off (vLLM before PR 32951): the CPU waits for the accepted counts of the
        in-flight steps, then prepares with the true positions. Returns the per-slot shift."""
        sd = self.sd
        if sd is None or sd.optimistic or not sd.drafts_in_flight(self.inflight):
            return None
        for f in self.inflight:
            if not sd.counts.ready(f.ring):
                t0 = self.hooks.sync_begin()
                sd.counts.wait(f.ring)
                self.hooks.sync_end(row, t0)
        return sd.host_shift(self.inflight, self.states)

    def _prepare(self, batch: ScheduledBatch, row: int, shift=None) -> StepInputs:
        """Host work first, then the step's first GPU work (the hooks' GPU start mark sits
        between them, so a synchronous step's GPU interval excludes this host time)."""
        for r in batch.preempted:  # recomputed later from their confirmed tokens
            self._release_slot(self.states[r.index])
        new = []
        for e in batch.entries:
            st = self.states[e.req.index]
            if st.slot < 0:
                self._take_slot(st)
                new.append(st)
        sd = self.sd
        width = self.sampler.forced_width  # what `init_slot` will widen `forced` to
        if sd is not None:  # plain decoding sends forced tokens in the rows instead
            for st in new:
                if st.forced is not None:
                    width = max(width, len(st.forced))
        shape = batch.shape
        bucket = self.graph_bucket(shape)  # a decode graph, else maybe a mixed step's graph
        mixed_rows = 0
        if not bucket and self.mixed is not None and not shape.is_pure_decode:
            bucket = self.mixed.bucket_for(shape.num_tokens)
            if bucket:
                num_gen = sum(1 for e in batch.entries if e.generates)
                mixed_rows = self.mixed.rows_for(bucket, num_gen)
        if sd is None:
            step = self.inputs.fill(batch, self.states, bucket, width, mixed_rows)
        else:  # seed 5 on: the GPU corrects what in-flight steps rejected (`sd.correct`)
            fix = sd.optimistic and sd.drafts_in_flight(self.inflight)
            known = sd.rejected_known if fix else None
            drafts = sd.cpu_drafts if sd.cpu_proposer is not None else None
            step = self.inputs.fill(batch, self.states, bucket, width, known, shift, drafts)
        self.hooks.gpu_begin(row)
        for st in new:  # device state of the new slots, enqueued before their first use
            self._init_slot(st)
        assert self.sampler.forced_width == width
        if self.tp is None:
            self.inputs.send(step, finish=not self._graph_samples(step))
        else:  # the rest after the broadcast (launch_batch)
            self.inputs.upload(step)
        if sd is not None:
            sd.correct(step, self.cfg.block_size)
        return step

    # ---- tensor parallelism ------------------------------------------------------------------
    def _broadcast(self, step: StepInputs, row: int) -> None:
        """Rank 0: the step to every worker rank (`serve_step`): its sizes and hooks `row` (the
        workers' launch record names it, engine.tp.ranktimes) in one header with
        the sampler state of slots initialised since the last step and the step's host input
        arrays (engine.tp.ring: all in one shared-memory slot; each worker uploads them as this
        rank did, so its inputs are bit-identical and NCCL carries only the model's
        collectives). Host arrays too large for a slot go as a device broadcast instead."""
        tp = self.tp
        assert tp is not None
        parts = self.broadcast_parts
        t0 = time.perf_counter_ns() if parts is not None else 0
        ids = self._init_payload()
        host = self.inputs.host_arrays(step)
        in_ring = tp.fits_ring(ids, *host)
        t1 = time.perf_counter_ns() if parts is not None else 0
        a = step.attn
        tp.send_header(
            OP_STEP, step.ring, step.num_reqs, step.num_tokens, step.num_gen,
            step.rows.hist_rows.numel(), step.bucket, step.padded_tokens, a.max_query_len,
            a.max_seq_len, step.num_pairs, step.table_cols, step.mixed, len(self._inits),
            0 if ids is None else len(ids) - 3 * len(self._inits), int(in_ring), row,
            payload=ids, arrays=host if in_ring else (),
        )  # fmt: skip
        self._inits.clear()
        t2 = time.perf_counter_ns() if parts is not None else 0
        if not in_ring:
            self.inputs.broadcast(step, tp)
        if parts is not None:
            parts.append((t1 - t0, t2 - t1, time.perf_counter_ns() - t2))
        if self.broadcast_ring is not None:
            self.broadcast_ring.append(int(in_ring))

    def _init_payload(self) -> np.ndarray | None:
        """[slot, prompt length (-1: no history), output length] per initialised slot, then
        every history's ids; None when no slot was initialised."""
        if not self._inits:
            return None
        head, tail = [], []
        for slot, history in self._inits:
            if history is None:
                head += [slot, -1, 0]
            else:
                prompt, outputs = history
                head += [slot, len(prompt), len(outputs)]
                tail += [np.asarray(prompt, np.int64), np.asarray(outputs, np.int64)]
        return np.concatenate([np.asarray(head, np.int64), *tail])

    def serve_step(self, header: np.ndarray, recv_ns: int = 0) -> None:
        """A worker rank: the device work of the step rank 0 announced in `header`
        (`_broadcast`; it reached this rank at perf_counter_ns `recv_ns`), in rank 0's order:
        new slots' sampler state, the inputs' broadcast, input finishing, forward (or graph
        replay), sampling into this rank's own state. The launch (finishing + forward, rank 0's
        `launch` phase) goes into the rank's record while rank 0 has it on."""
        tp = self.tp
        assert tp is not None and not tp.is_driver
        k, b, t_real, g, h, bucket, t, max_q, max_seq, pairs, cols, mixed, n_init, n_ids, ring = (
            int(x) for x in header[1:16]
        )
        step = self.inputs.views(k, b, t_real, g, h, bucket, t, max_q, max_seq, pairs, cols, mixed)
        n_payload = 3 * n_init + n_ids if n_init else 0
        if n_init:
            self._recv_inits(tp.recv_ints(n_payload), n_init)
        if ring:  # rank 0's host arrays, uploaded here as rank 0 uploaded them
            buf, pair_vals = tp.recv_arrays(n_payload, *self.inputs.host_shapes(step))
            self.inputs.stage_host(step, buf, pair_vals)
            self.inputs.upload(step)
        else:
            self.inputs.broadcast(step, tp)
        samples = self._graph_samples(step)
        launch0_ns = _now()
        self.inputs.apply(step, finish=not samples)
        logits = self.forward(step)
        rt = self.rank_times
        if rt is not None and rt.on:
            rt.add(int(header[16]), recv_ns, launch0_ns, _now())
        if not samples and g:  # as `_sample`: the tokens stay on this rank's device
            self.sampler.sample(logits[:g], step.rows, self.outputs.device_tokens[k, :g])

    def _recv_inits(self, payload: np.ndarray, n: int) -> None:
        """`_init_slot`'s sampler work on a worker, from `_init_payload`."""
        at = 3 * n
        for i in range(n):
            slot, plen, olen = (int(x) for x in payload[3 * i : 3 * i + 3])
            history = None
            if plen >= 0:
                history = (payload[at : at + plen], payload[at + plen : at + plen + olen])
                at += plen + olen
            self.sampler.init_slot(slot, history, None)

    def warm_forwards(self, compile_threads: int) -> tuple[int, str]:
        """engine.warmup's forward plan on this engine (every rank with tensor parallelism:
        rank 0 tells the workers, which run the same plan). Returns (steps, how compiled).
        Tensor-parallel ranks compile serially: a parallel pass that failed on one rank only
        would leave the ranks' collectives out of step."""
        from engine import warmup as W

        if self.tp is not None:
            compile_threads = 1
            if self.tp.is_driver:
                self.tp.send_header(OP_WARM_FORWARDS, compile_threads)
        plan = W.forward_plan(W.Limits.of_engine(self))
        return len(plan), W.run_forward_plan(self, plan, compile_threads)

    def close(self) -> None:
        """Tensor parallelism (rank 0): the workers drop their engine, this engine destroys its
        CUDA graphs (NCCL's destroy of the group waits for every graph that captured one of
        its collectives), and the workers stop when this engine started them. Idempotent;
        nothing to do at tensor_parallel_size 1. A closed engine runs no more steps."""
        tp = self.tp
        if tp is None or not tp.is_driver or self._closed:
            return
        self._closed = True
        if tp.workers is not None:
            with contextlib.suppress(Exception):  # workers gone: close() below reaps them
                tp.send_header(OP_END_ENGINE)
        with deadline("rank 0: drop the engine's CUDA graphs", SHUTDOWN_S, tp.on_expiry):
            self.release_graphs()
        if self._owns_tp:
            tp.close()

    def release_graphs(self) -> None:
        """Destroy this engine's CUDA graphs now, whoever else holds the engine (tensor
        parallelism: before the process group goes). The engine runs no more steps after it."""
        self._closed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay in flight
        for owner in (getattr(self, "graphs", None), getattr(self, "mixed", None)):
            if owner is not None:
                for graph in owner.graphs.values():
                    graph.reset()
                owner.graphs.clear()
        self.graphs = self.mixed = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def graph_bucket(self, shape: BatchShape) -> int:
        """The decode graph a batch of this shape replays, 0 = eager: pure decode with k drafts
        on every row (or none) and a bucket that holds it."""
        uniform = shape.draft_tokens == (self.q - 1) * shape.num_reqs
        if self.graphs is None or not shape.is_pure_decode or not uniform:
            return 0
        return self.graphs.bucket_for(shape.num_reqs)

    def _graph_samples(self, step: StepInputs) -> bool:
        """Does this step's CUDA graph finish its inputs and sample (engine.graphs; a mixed
        step's graph, engine.mixed_graphs, always does)?"""
        if step.mixed:
            return True
        return bool(step.bucket) and self.graphs is not None and self.graphs.samples

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Logits [>= G, vocab] float32; row g belongs to the g-th generating entry."""
        hist = step.rows.hist_rows.numel() > 0
        if step.mixed:  # sampled by the graph; logits only where kept (CPU: always)
            assert self.mixed is not None
            return self.mixed.replay(step.bucket, step.mixed, hist)  # type: ignore[return-value]
        if step.bucket:
            assert self.graphs is not None
            return self.graphs.replay(step.bucket, hist)
        hidden = self.model(step.input_ids, step.positions, step.attn, self.kv_cache)
        return self.model.compute_logits(hidden[step.logits_idx])

    def _sample(
        self, batch: ScheduledBatch, row: int, step: StepInputs, logits: torch.Tensor
    ) -> InFlight:
        hist_rows = self._update_async_output_token_ids(batch)
        g = step.num_gen
        n = g * self.q  # tokens this step returns: k + 1 per generating entry with drafts
        out = self.outputs.device_tokens[step.ring, :n]
        if self.sd is not None:
            self.sd.sample(self.sampler, batch, self.states, step, logits, out)
        elif self._graph_samples(step):  # sampled by the graph: one copy to the ring
            if step.mixed:
                assert self.mixed is not None
                out.copy_(self.mixed.tokens[step.bucket, step.mixed][:g])
            else:
                assert self.graphs is not None
                out.copy_(self.graphs.tokens[step.bucket][:g])
        elif g:
            self.sampler.sample(logits[:g], step.rows, out)
        if self.sd is None or self.sd.cpu_proposer is not None:
            self.hooks.gpu_end(row)  # else the GPU proposer's kernels end the step
        self.outputs.publish(step.ring, n)
        for e in batch.entries:  # bookkeeping: a placeholder per token this batch may emit
            if e.generates:
                out_list = self.states[e.req.index].output
                if e.num_drafts:
                    out_list.extend([-1] * (1 + e.num_drafts))
                else:
                    out_list.append(-1)
        return InFlight(batch, row, step.ring, g, hist_rows)

    def _draft(self, flight: InFlight, step: StepInputs) -> None:
        """Propose the next step's drafts: ngram-gpu enqueues kernels; ngram-cpu first waits
        for this step's tokens (a sync: the reason it runs with one batch in flight)."""
        sd, h = self.sd, self.hooks
        if sd is not None and sd.cpu_proposer is not None:
            t0 = h.sync_begin()
            self.outputs.wait(flight.ring)
            sd.counts.wait(flight.ring)
            h.sync_end(flight.row, t0)
        h.begin(P.DRAFT)
        if sd is not None:
            if sd.gpu_proposer is not None:
                ids = self.outputs.device_tokens[flight.ring, : flight.num_gen * self.q]
                h.mark(flight.row, DRAFT_BEGIN)
                sd.draft_gpu(flight.batch, step, ids)
                h.gpu_end(flight.row)
            else:
                host = self.outputs.tokens(flight.ring, flight.num_gen * self.q)
                counts = sd.counts.counts(flight.ring, flight.num_gen)
                sd.draft_cpu(flight.batch, self.states, host, counts)
        h.end(flight.row)

    def _update_async_output_token_ids(self, batch: ScheduledBatch) -> dict[int, int] | None:
        """vLLM's step of the same name, for needs-history requests (seed 3): fill the -1
        placeholders of the oldest in-flight batch's tokens in the CPU output lists. The scan
        that finds them (`first_placeholder`, front or back) runs for every needs-history
        request of that batch; the fill happens when its copy has landed. vLLM blocks here for
        it; this engine only polls, so the wait stays in `sync` (the penalties themselves read
        GPU token counts, not these lists). Returns this batch's needs-history rows."""
        oldest = self.inflight[0] if self.inflight else None
        prev = oldest.hist_rows if oldest is not None else None
        arrived = prev is not None and self.outputs.ready(oldest.ring)  # type: ignore[union-attr]
        mine: dict[int, int] | None = None
        g = 0
        for e in batch.entries:
            if not e.generates:
                continue
            req = e.req
            if req.needs_history:
                if mine is None:
                    mine = {}
                mine[req.index] = g
                pg = prev.get(req.index) if prev is not None else None
                out = self.states[req.index].output
                if pg is not None and out and out[-1] == -1:
                    if arrived:
                        q = self.q
                        ring = oldest.ring  # type: ignore[union-attr]
                        toks = self.outputs.host[ring, pg * q : pg * q + q].tolist()
                        if q > 1:  # verified ids: the valid ones lead, -1 after
                            toks = toks[: toks.index(-1)] if -1 in toks else toks
                        update_async_output_token_ids(out, toks, self.reverse_scan)
                    else:
                        first_placeholder(out, self.reverse_scan)
            g += 1
        return mine

    def _process_outputs(self, flight: InFlight) -> None:
        if self.sd is not None:
            return self._process_spec_outputs(flight)
        batch = flight.batch
        emitted = [1] * len(batch.entries)  # no drafts: every generating entry emits one token
        taken = self.sched.emitted_tokens(batch, emitted)
        tokens = self.outputs.tokens(flight.ring, flight.num_gen).tolist()
        now = _now()
        g = 0
        for e, n in zip(batch.entries, taken):
            if e.generates:
                if n:
                    self.states[e.req.index].apply(tokens[g], now)
                g += 1
        finished = self.sched.complete(batch, emitted)
        for r in finished:
            st = self.states[r.index]
            st.finish_ns = now
            self._release_slot(st)
        self.hooks.finished[flight.row] = len(finished)

    def _process_spec_outputs(self, flight: InFlight) -> None:
        """With drafts: entry g emitted counts[g] = accepted + 1 tokens (row g of the verified
        ids); they replace the first of its 1 + drafts placeholders, the rest are dropped, and
        the policy rewinds the rejected drafts' KV (`complete`)."""
        sd = self.sd
        assert sd is not None
        batch, q = flight.batch, self.q
        emitted = sd.emitted(flight)
        taken = self.sched.emitted_tokens(batch, emitted)
        host = self.outputs.tokens(flight.ring, flight.num_gen * q)
        now = _now()
        g = 0
        for e, n in zip(batch.entries, taken):
            if not e.generates:
                continue
            st = self.states[e.req.index]
            if e.req.status != Status.FINISHED:  # else its placeholders are gone already
                i = e.req.num_output_tokens
                if n:
                    st.apply_many(host[g * q : g * q + n].tolist(), now)
                del st.output[i + n : i + 1 + e.num_drafts]
            g += 1
        finished = self.sched.complete(batch, emitted)
        sd.applied(batch, self.states, emitted)
        for r in finished:
            st = self.states[r.index]
            del st.output[r.output_len :]  # placeholders of later steps it no longer needs
            st.finish_ns = now
            self._release_slot(st)
        self.hooks.finished[flight.row] = len(finished)

    # ---- slots -------------------------------------------------------------------------------
    def _take_slot(self, st: RequestState) -> None:
        """Host side of a request's first step after admission: a slot, its block-table row
        marked unsent, and (spec) the proposer's start."""
        st.slot = self.slots.take()
        self.inputs.reset_slot(st.slot)
        if self.sd is not None:
            self.sd.take_slot(st)

    def _init_slot(self, st: RequestState) -> None:
        """Device side of a new slot (sampler state, spec draft state): enqueued inside the
        step's GPU interval, before the slot's first use."""
        sd = self.sd
        history = (st.prompt_ids, st.confirmed_outputs()) if st.req.needs_history else None
        self.sampler.init_slot(st.slot, history, st.forced if sd is not None else None)
        if self.tp is not None:  # the workers' samplers: with the next step (`_broadcast`)
            self._inits.append((st.slot, history))
        if sd is not None:
            sd.reset_slot(st)

    def _release_slot(self, st: RequestState) -> None:
        if st.slot >= 0:
            self.slots.give(st.slot)
            st.slot = -1
            if self.sd is not None:
                self.sd.release(st)

    # ---- synthetic batches (replay.gpu.shapes; a run never calls these) ------------------------
    def hold_slot(self, index: int) -> None:
        """Give running request `index` a slot and the slot's device state, as its first step
        would, outside any step: a request of a synthetic batch that has been running for
        earlier steps. Its blocks reach the device with its next step's inputs."""
        st = self.states[index]
        if st.slot < 0:
            self._take_slot(st)
            self._init_slot(st)

    def release_slot(self, index: int) -> None:
        """Give request `index`'s slot back, so that its next step takes one again."""
        self._release_slot(self.states[index])

    def reset_requests(self) -> None:
        """Forget every request: slots back, nothing in flight, a fresh scheduler over the whole
        KV cache (whose contents stay). Graphs, buffers and the sampler's tables stay."""
        for st in self.states:
            self._release_slot(st)
        self.states = []
        self.inflight.clear()
        self.sched = Scheduler(self.sched.cfg)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self, inp: RequestInput, arrival_ns: int | None = None, key: int | None = None
    ) -> int:
        """Queue a request; returns its index (`Request.index`, dense over the engine's life).
        `key` (default: the index) seeds its synthetic prompt and sampling noise: the same key
        gives the same tokens whatever else runs. Raises ValueError naming the request when it
        can never run (too long for the model or the cache)."""
        index = len(self.states)
        key = index if key is None else key
        st = make_state(inp, index, key, self.cfg.seed, self.spec.vocab_size)
        self.sched.add(st.req)
        st.arrival_ns = _now() if arrival_ns is None else arrival_ns
        self.states.append(st)
        return index

    @property
    def has_work(self) -> bool:
        return self.sched.has_unfinished or bool(self.inflight)

    def start(self) -> int:
        """Begin recording (phase hooks, GPU events, GC pauses; with tensor parallelism also
        the worker ranks' launches); returns the run's zero ns."""
        if self.tp is not None and self.tp.is_driver and self.tp.workers is not None:
            self.tp.send_header(OP_RANK_TIMES, RANK_TIMES_START)
        self.hooks.install_gc()
        return self.hooks.start()

    def finish(self) -> StepTrace:
        """Stop recording and return what the hooks saw (synchronizes the device), with the
        worker ranks' launch record (`StepTrace.rank_ns`) under tensor parallelism."""
        self.hooks.remove_gc()
        trace = self.hooks.finish()
        if self.tp is not None and self.tp.is_driver:
            trace.rank_ns = self._gather_rank_times()
        return trace

    def _gather_rank_times(self) -> np.ndarray:
        """Rank 0: every worker's launch record since `start` (engine.tp.ranktimes), rows of
        all ranks in rank order; empty when a worker is gone (a failed run keeps its steps)."""
        tp = self.tp
        assert tp is not None
        if tp.workers is None or not tp.workers.alive():
            return empty_table()
        tp.send_header(OP_RANK_TIMES, RANK_TIMES_GATHER)
        with deadline("rank 0: gather the worker ranks' launch times", SHUTDOWN_S,
                      tp.on_expiry, tp.peers_alive):  # fmt: skip
            tables = tp.gather_object(empty_table())
        assert tables is not None
        return np.concatenate([t for t in tables[1:] if isinstance(t, np.ndarray)] or
                              [empty_table()])  # fmt: skip

    def run(
        self,
        requests: Trace | Sequence[RequestInput],
        arrival: str | None = None,
        on_step: Callable[[Engine], None] | None = None,
    ) -> list[RequestOutput]:
        """Serve `requests` to completion; outputs in the given order (a trace: arrival order).
        arrival 'asap' queues everything at once, 'realtime' at arrival_s after the start
        (default: config key `arrival`). A request's key is its arrival rank, so repeated runs
        give the same tokens. The hooks' record is left in `self.trace`."""
        mode = arrival or self.cfg.arrival
        if mode not in ("asap", "realtime"):
            raise ValueError(f"arrival must be 'asap' or 'realtime', got {mode!r}")
        items = inputs_from_trace(requests) if isinstance(requests, Trace) else list(requests)
        order = sorted(range(len(items)), key=lambda i: items[i].arrival_s)
        index = [0] * len(items)
        t0 = self.start()
        try:
            i = 0
            while i < len(order) or self.has_work:
                now = _now()
                while i < len(order):
                    inp = items[order[i]]
                    due = t0 + int(inp.arrival_s * 1e9)
                    if mode == "realtime" and due > now:
                        break
                    arrival_ns = due if mode == "realtime" else now
                    index[order[i]] = self.add_request(inp, arrival_ns, key=i)
                    i += 1
                if not self.has_work:  # idle until the next arrival (not a bubble)
                    time.sleep(max(0.0, (due - _now()) / 1e9))
                    continue
                if not self.step():
                    raise RuntimeError("the scheduler made no progress with requests waiting")
                if on_step is not None:
                    on_step(self)
        finally:
            self.trace = self.finish()
        return [self.states[j].result() for j in index]

    # ---- start-up ----------------------------------------------------------------------------
    def _kv_blocks(self) -> int:
        """config num_kv_blocks if > 0; on CPU a fixed budget; on CUDA what is free after the
        weights and a profiling run at the largest batch, times kv_memory_fraction."""
        cfg = self.cfg
        if cfg.num_kv_blocks > 0:
            return cfg.num_kv_blocks
        local = self.model.local  # this rank's KV heads
        per_block = kv_cache_bytes_per_block(local, cfg.block_size, self.model.dtype)
        if self.device.type != "cuda":
            return max(1, CPU_KV_BYTES // per_block)
        activation_bytes = self._profile_run()
        free_bytes, _ = torch.cuda.mem_get_info(self.device)
        blocks = kv_blocks_from_free_bytes(cfg, local, free_bytes - activation_bytes)
        return blocks if self.tp is None else self.tp.agree_min(blocks)  # one policy, all ranks

    @torch.no_grad()
    def _profile_run(self) -> int:
        """Peak activation bytes of an eager forward over max_num_batched_tokens tokens plus
        sampling (with penalties) of max_num_seqs rows. Leaves the sampler state zeroed."""
        cfg, dev = self.cfg, self.device
        n_tok = self.inputs.max_tokens
        seq_len = min(n_tok, self.max_model_len)
        q_lens = [seq_len] * (n_tok // seq_len) + ([n_tok % seq_len] if n_tok % seq_len else [])
        bs = cfg.block_size
        per_seq = -(-seq_len // bs)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(q_lens))]
        kv = allocate_kv_cache(self.model.local, per_seq * len(q_lens), bs, self.model.dtype, dev)
        attn = AttentionMetadata.from_lists(q_lens, q_lens, tables, bs, dev)
        ids = torch.zeros(n_tok, dtype=torch.int32, device=dev)
        pos = torch.cat([torch.arange(q, dtype=torch.int32, device=dev) for q in q_lens])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        hidden = self.model(ids, pos, attn, kv)
        g = cfg.max_num_seqs * self.q  # logits rows: k + 1 per request with drafts
        logits = self.model.compute_logits(hidden[torch.arange(g, device=dev) % n_tok])
        self._profile_sample(logits)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(dev) - before
        del hidden, logits, kv
        self.sampler.counts.zero_()
        self.sampler.last_sampled.zero_()
        torch.cuda.empty_cache()
        return peak

    def _profile_sample(self, logits: torch.Tensor) -> None:
        """Sampling of the largest step's logits rows [G, vocab], every row with history, on
        the path a step of this engine takes: speculative decoding verifies max_num_seqs x
        (k + 1) rows with `Sampler.choose` (engine.spec.decoder; the drafts' penalty history
        [G, vocab] lives alongside the logits), plain decoding samples its max_num_seqs rows
        with `Sampler.sample`, whose greedy kernel (CUDA, temperature 0) holds at most
        num_slots + 1 rows: verification rows never go there."""
        g = logits.shape[0]
        r = torch.arange(g, dtype=torch.int32, device=logits.device)
        rows = SampleRows(r % self.cfg.max_num_seqs, r * 0, r, r * 0 - 1, r, forced_tok=r * 0 - 1)
        if self.sd is not None:
            extra = torch.zeros_like(logits, dtype=torch.int32)
            self.sampler.choose(logits, rows, extra)
        else:
            self.sampler.sample(logits, rows, torch.empty_like(r))
