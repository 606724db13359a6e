"""A synthetic batch as a real engine step, for `replay shapes` (replay.gpu.shapes).

`stage(engine, batch)` turns a grid batch (replay.analysis.shapes_grid) into engine requests whose
context is already "in the KV cache" and lets the engine's own scheduler build the step:
- each row is an `Engine.add_request` (synthetic prompt ids), then `resume` puts it where its
  earlier steps would have left it: running, `start` tokens computed, blocks for its step held
  (the block manager's `allocate`; a batch needing more blocks than the cache has gets block
  ids that repeat, outside the manager's accounting: `wrapped`). A decode row has a prompt of
  `start` tokens and one confirmed output (its step feeds that token and its drafts); a prefill
  chunk ends its prompt. KV contents are whatever the cache holds. A `hist` row's request needs
  its output history (`needs_history`): `hold_slot` sets its sampler history (prompt mask and
  output counts) up as a run's first step does, and its step samples with the penalties.
- rows that ran before this step hold a slot (`Engine.hold_slot`: the device state a first step
  sets up, outside the timing) and, speculative decoding, their drafts: `draft_hint` for the
  policy, and on ngram-cpu the draft ids; ngram-gpu reads its device draft table (-1 there: no
  draft, fed as token 0). New rows (a fresh chunk or a prefix-cache hit) take their slot in
  the step, as a run's first step of a request does.
- `Scheduler.schedule()` then makes the batch (entries, BatchShape); it must be the grid's.

`Staged.launch()` is `Engine.launch_batch` on that batch: prepare_inputs (inputs.fill, the hooks'
GPU start, new slots' device state, inputs.send), the forward (a decode graph bucket with its
sampling, or eager), sampling (spec: verification), draft (ngram-gpu's proposer ends the step):
the code a run's step runs, between the same two marks. `MarkHooks` takes those marks on the
sweep's own events. The same batch is launched repeatedly: `before()` restores what a launch
consumed (ngram-cpu's drafts; held rows that opened a block this step, which a run sends with
the step, are marked unsent again) and `after()` hands new rows' slots back (so the next launch
sets them up again) and drops the launch's output placeholders. Nothing is ever completed: the
requests are dropped with `Engine.reset_requests` before the next batch.

Held decode rows: row i opens a new block in its step when i % block_size == 0 (a run's rows
do, on average, one step in block_size); its block id then travels with the step's inputs.
ngram-cpu: the proposer (host work after the step's end mark) scans each held row's token list
cut to its last CPU_PROPOSER_TAIL tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from bubblesim.core.policy import ScheduledBatch, Scheduler
from bubblesim.core.request import Request, Status
from engine.engine import Engine, InFlight
from engine.hooks import StepHooks
from engine.requests import RequestInput
from replay.analysis.shapes_grid import Batch, Entry

_now = time.perf_counter_ns
CPU_PROPOSER_TAIL = 64  # ngram-cpu: tokens of a held row's list its proposer scans (untimed)


class MarkHooks(StepHooks):
    """The engine's hooks with the GPU marks of the step being sampled taken on two events of
    the sweep's (CUDA; recorded on the current stream as the engine's are) or as host times
    (CPU). At the end mark it asks whether the start event has fired (`Event.query`, which never
    blocks): `early` True means the GPU reached the step before the host had issued all of it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, capacity=64, ring=1)
        self.begin_ns = self.end_ns = 0
        self.early = False
        self.marks = 0  # gpu_begin calls (tests: the engine's path set the marks)
        if self.cuda:
            self.start_ev = torch.cuda.Event(enable_timing=True)
            self.end_ev = torch.cuda.Event(enable_timing=True)

    def gpu_begin(self, row: int) -> None:
        if self.cuda:
            self.start_ev.record()
        self.begin_ns = _now()
        self.marks += 1

    def gpu_end(self, row: int) -> None:
        if self.cuda:
            self.end_ev.record()
            self.early = self.start_ev.query()
        self.end_ns = _now()

    def gpu_ms(self) -> float:
        """The marked interval (CUDA: call after the device is synchronized)."""
        if self.cuda:
            return float(self.start_ev.elapsed_time(self.end_ev))
        return (self.end_ns - self.begin_ns) / 1e6


class StageError(ValueError):
    """The engine cannot hold this batch (a request too long for its KV cache)."""


def resume(sched: Scheduler, req: Request, computed: int, outputs: int, cached: int) -> None:
    """A waiting request as earlier steps would have left it: running (admitted after every
    running one), `computed` tokens' KV written, `outputs` confirmed output tokens, `cached`
    of its prompt served by the prefix cache. Blocks are given separately (`give_blocks`)."""
    sched.waiting.remove(req)
    req.status = Status.RUNNING
    sched.running.append(req)
    req.num_output_tokens = outputs
    req.num_computed_tokens = computed
    req.num_cached_tokens = cached


# scatter_free is O(free blocks) per batch (~20 ms at 40k blocks): a cache of millions of blocks
# (a small model on a large GPU with the cache sized from free memory) keeps the policy's
# consecutive ids instead; the layout made no measurable difference to decode step time on an
# H100 (llama3.2-1b, 40k blocks, 2026-11-26), so this only bounds the sweep's host time
SCATTER_MAX_BLOCKS = 262_144


def give_blocks(
    sched: Scheduler, reqs: list[Request], totals: list[int], scatter: int | None = None
) -> bool:
    """Blocks for `totals[i]` tokens of each request: from the block manager when they fit the
    cache (with `scatter`, a seed, and at most SCATTER_MAX_BLOCKS free blocks, from free blocks
    put in random order first: the scattered layout of a cache that has served many requests),
    else block ids 0, 1, ... repeating over the cache
    (requests share blocks; the scheduler is thrown away after the batch). Returns whether the
    ids had to repeat."""
    bm = sched.blocks
    need = [bm.blocks_for(t) for t in totals]
    if sum(need) <= bm.num_free:
        if scatter is not None and bm.num_free <= SCATTER_MAX_BLOCKS:
            bm.scatter_free(scatter)  # a served cache's layout: scattered ids, as in a run
        for r, t in zip(reqs, totals):
            assert bm.allocate(r, t)
        return False
    n, at = bm.num_blocks, 0
    for r, k in zip(reqs, need):
        r.block_ids = [(at + j) % n for j in range(k)]
        at += k
    return True


@dataclass
class Staged:
    """A synthetic batch scheduled in `engine`, ready to be launched (repeatedly)."""

    engine: Engine
    batch: Batch
    sched_batch: ScheduledBatch
    new_rows: list[int]  # request indices whose slot is set up in the step
    cpu_drafts: dict[int, list[int]]  # ngram-cpu: request index -> its drafts
    crossing: list[int]  # held decode rows that open a block in the step
    wrapped: bool
    kv_blocks: int
    bucket: int  # the decode graph it replays (0: eager)
    base_outputs: list[int]  # each row's output list length before any launch
    gpu_lengths: tuple[torch.Tensor, torch.Tensor] | None = None  # ngram-gpu: held slots, lengths

    def before(self) -> None:
        """State a launch consumed, restored (call before the spin: it is not timed)."""
        eng = self.engine
        if self.gpu_lengths is not None and eng.sd is not None and eng.sd.gpu_proposer:
            # ngram-gpu appended the launch's tokens to the held rows' device token lists:
            # back to their length before it (the proposer's window is the rows' length)
            slots, lengths = self.gpu_lengths
            eng.sd.gpu_proposer.num_tokens.index_copy_(0, slots, lengths)
        if eng.sd is not None and eng.sd.cpu_proposer is not None:
            lists = eng.sd.cpu_proposer.tokens
            for idx, d in self.cpu_drafts.items():
                eng.sd.cpu_drafts[idx] = list(d)
                # the proposer runs after the end mark (`draft`): a short list keeps its host
                # scan from slowing the sweep (a 32k-token row costs milliseconds a launch)
                lists[idx] = lists[idx][-CPU_PROPOSER_TAIL:]
        sent = eng.inputs.sent_blocks  # InputBuffers: block ids of a slot already on the device
        for idx in self.crossing:  # once all are there (a first launch sends them all)
            st = eng.states[idx]
            sent[st.slot] = min(sent[st.slot], len(st.req.block_ids) - 1)

    def launch(self) -> InFlight:
        """The step: `Engine.launch_batch` on a fresh hooks row."""
        eng = self.engine
        row = eng.hooks.new_row(self.sched_batch.shape)
        return eng.launch_batch(self.sched_batch, row)

    def after(self) -> None:
        """New rows give their slot back; each row's output list drops the launch's
        placeholders (call once the device is synchronized)."""
        eng = self.engine
        for idx in self.new_rows:
            eng.release_slot(idx)
        for e, n in zip(self.sched_batch.entries, self.base_outputs):
            del eng.states[e.req.index].output[n:]
        if eng.hooks.num_steps > 1000:
            eng.hooks.reset()


def stage(engine: Engine, batch: Batch, seed: int = 0) -> Staged:
    """Requests for `batch` in `engine` (module docstring), scheduled by its policy. Raises
    StageError when the engine refuses a request (too long for its cache)."""
    engine.reset_requests()
    sched = engine.sched
    vocab = engine.spec.vocab_size
    rng = np.random.default_rng([seed, len(batch.entries), batch.num_tokens])
    reqs: list[Request] = []
    for i, e in enumerate(batch.entries):
        reqs.append(_add(engine, e, i, rng))
    wrapped = give_blocks(sched, reqs, [e.seq_len for e in batch.entries], scatter=seed)
    new_rows, cpu_drafts, crossing = [], {}, []
    bs = engine.cfg.block_size
    for i, (e, r) in enumerate(zip(batch.entries, reqs)):
        if e.is_new:
            new_rows.append(r.index)
            continue
        engine.hold_slot(r.index)
        if not e.prefill:
            r.draft_hint = e.drafts if engine.sd is not None else None
            if engine.sd is not None and engine.sd.cpu_proposer is not None:
                cpu_drafts[r.index] = rng.integers(0, vocab, e.drafts).tolist()
            if i % bs == 0:
                crossing.append(r.index)
    sb = sched.schedule()
    got = (
        [(x.start_pos, x.num_tokens, x.is_prefill, x.num_drafts) for x in sb.entries] if sb else []
    )
    want = [(e.start, e.n, e.prefill, e.drafts) for e in batch.entries]
    if got != want:
        raise RuntimeError(
            f"replay.shapes: the scheduler made {got[:3]}... of the grid's {batch.label} batch "
            f"{want[:3]}... ({len(got)} vs {len(want)} rows)"
        )
    assert sb is not None
    return Staged(
        engine=engine,
        batch=batch,
        sched_batch=sb,
        new_rows=new_rows,
        cpu_drafts=cpu_drafts,
        crossing=crossing,
        wrapped=wrapped,
        kv_blocks=sum(len(r.block_ids) for r in reqs),
        bucket=engine.graph_bucket(sb.shape),
        base_outputs=[len(engine.states[r.index].output) for r in reqs],
        gpu_lengths=_proposer_lengths(engine, [r for r in reqs if r.index not in new_rows]),
    )


def _proposer_lengths(
    engine: Engine, held: list[Request]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """ngram-gpu: the held rows' slots and known token counts (what `Engine.hold_slot` put in
    the proposer's device token lists), on the device."""
    if engine.sd is None or engine.sd.gpu_proposer is None or not held:
        return None
    slots = [engine.states[r.index].slot for r in held]
    known = [r.prompt_len + r.num_output_tokens for r in held]
    dev = engine.device
    return torch.tensor(slots, device=dev), torch.tensor(known, dtype=torch.int32, device=dev)


def _add(engine: Engine, e: Entry, i: int, rng: np.random.Generator) -> Request:
    """Row i as an engine request, resumed. A decode row: a prompt of `start` tokens and one
    confirmed output, room for its drafts and one more output. A chunk: a prompt that it ends,
    one output to come."""
    if e.prefill:
        inp = RequestInput(f"shape-{i}", e.start + e.n, 1, needs_history=e.hist)
    else:
        inp = RequestInput(f"shape-{i}", e.start, e.drafts + 2, needs_history=e.hist)
    try:
        idx = engine.add_request(inp, arrival_ns=0)
    except ValueError as err:
        raise StageError(str(err)) from None
    st = engine.states[idx]
    req = st.req
    if e.prefill:
        cached = e.start if e.hit else 0
        resume(engine.sched, req, e.start, 0, cached)
    else:
        tok = int(rng.integers(0, engine.spec.vocab_size))
        st.token_ids[req.prompt_len] = tok
        st.output.append(tok)
        resume(engine.sched, req, e.start, 1, 0)
    return req
