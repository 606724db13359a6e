"""The scheduling policy, shared by the engine and the simulator: pure Python over integers.

Continuous batching under `max_num_seqs` and a token budget, chunked prefill, paged KV blocks,
preemption by recompute, prefix caching and speculative-draft placeholders.
State advances when a batch is launched (`schedule`) and results apply when it completes
(`complete`), so how many batches are in flight is a property of the caller's loop.

Rules:
- running requests are served first in admission order, then waiting ones FCFS;
- a request is not scheduled once the batches in flight will surely finish it
  (each emits >= 1 token), and its drafts are capped so it never needs more than `output_len`;
- when blocks run out, the most recently admitted running request with nothing in flight is
  preempted (its KV dropped, recomputed later); requests with batches in flight are never
  preempted (their results would be lost); no new request is admitted in a step that preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from bubblesim.core.policy.blocks import BlockManager
from bubblesim.core.request import Request, Status
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape

# Scheduler.shape_row's order (BatchShape's positional fields)
assert SHAPE_FIELDS == (
    "num_reqs", "num_prefill_reqs", "prefill_tokens", "decode_tokens", "draft_tokens",
    "kv_read_tokens", "attn_pairs", "max_kv_tokens", "history_tokens", "context_tokens",
    "new_reqs", "finished_reqs",
), SHAPE_FIELDS  # fmt: skip

RUNNING, FINISHED = Status.RUNNING, Status.FINISHED


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    max_model_len: int
    chunked_prefill: bool = True
    prefix_caching: bool = True
    spec_k: int = 0  # draft tokens per decode step (0 = no speculative decoding)


@dataclass(slots=True)
class Entry:
    """One request's share of a step: `num_tokens` query tokens at positions
    `start_pos .. start_pos + num_tokens - 1`; the last `num_drafts` are draft tokens."""

    req: Request
    start_pos: int
    num_tokens: int
    num_drafts: int
    generates: bool  # the chunk reaches the end of the known tokens: emits 1..1+drafts tokens
    is_prefill: bool


@dataclass(slots=True)
class ScheduledBatch:
    step: int
    entries: list[Entry]
    shape: BatchShape
    preempted: list[Request] = field(default_factory=list)
    completed: bool = False


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self._pending_free: list[Request] = []  # finished with batches still in flight
        # (request, its tokens, free blocks, budget) of admit's last failed allocation: see admit
        self._blocked: tuple[Request, int, int, int] | None = None

    # ---- intake -----------------------------------------------------------------------------
    def check_fits(self, req: Request) -> str | None:
        """Why the request can never run, or None."""
        total = req.prompt_len + req.output_len
        if total > self.cfg.max_model_len:
            return f"needs {total} tokens > max_model_len {self.cfg.max_model_len}"
        if self.blocks.blocks_for(total) > self.cfg.num_blocks:
            return (
                f"needs {self.blocks.blocks_for(total)} KV blocks but the cache has "
                f"{self.cfg.num_blocks}"
            )
        if not self.cfg.chunked_prefill and total > self.cfg.max_num_batched_tokens:
            return "prompt exceeds max_num_batched_tokens and chunked_prefill is off"
        return None

    def add(self, req: Request) -> None:
        why = self.check_fits(req)
        if why is not None:
            raise ValueError(f"request {req.request_id!r} {why}")
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Pick the next batch and advance state as if it were launched now."""
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        bs = cfg.block_size
        entries: list[Entry] = []
        preempted: list[Request] = []
        scheduled: set[int] = set()  # request indices (ints: iteration order never used)
        running = RUNNING
        # A copy: preemption removes requests from `running` while we walk it.
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != running:
                continue  # preempted earlier in this loop
            # `plan` inlined for the common case, a decode without drafts (hot path).
            out = req.num_output_tokens
            ph = req.num_placeholders
            start = req.num_computed_tokens
            if cfg.spec_k == 0 and req.prompt_len + out + ph - start == 1 and out + ph > 0:
                if out + req.num_inflight_gen >= req.output_len:
                    continue  # batches in flight will finish it
                e = Entry(req, start, 1, 0, True, False)
            else:
                plan = self.plan(req, budget)
                if plan is None:
                    continue
                e = plan
            total = e.start_pos + e.num_tokens
            if -(-total // bs) > len(req.block_ids) and not self._allocate_or_preempt(
                req, e, scheduled, preempted
            ):
                continue
            entries.append(e)
            scheduled.add(req.index)
            budget -= e.num_tokens
        if not preempted:
            budget = self.admit(entries, budget)
        if not entries:
            return None
        batch = ScheduledBatch(self.num_steps, entries, self.shape(entries), preempted)
        for e in entries:
            self.launch(e)
        self.num_steps += 1
        return batch

    # ---- the policy's primitives (the simulator's fast path runs them too) -------------------
    def plan(self, req: Request, budget: int) -> Entry | None:
        """The request's share of the next step within `budget` tokens (no blocks allocated,
        no state changed), or None when it takes none."""
        # Request.outputs_guaranteed, num_tokens and in_decode, read once (admit plans every
        # admission with it)
        out, ph, start = req.num_output_tokens, req.num_placeholders, req.num_computed_tokens
        if out + req.num_inflight_gen >= req.output_len:
            return None  # batches in flight will finish it
        known = req.prompt_len + out + ph - start
        if known == 1 and out + ph > 0:  # in decode
            drafts = self.num_drafts(req, budget) if self.cfg.spec_k > 0 else 0
            return Entry(req, start, 1 + drafts, drafts, True, False)
        n = known
        if n > budget:
            if not self.cfg.chunked_prefill:
                return None
            n = budget
        return Entry(req, start, n, 0, n == known, True)

    def num_drafts(self, req: Request, budget: int) -> int:
        """Draft tokens a decode of `req` verifies: spec_k (or the CPU proposer's hint),
        capped so it never needs more than output_len or max_model_len, and by the budget."""
        want = self.cfg.spec_k if req.draft_hint is None else req.draft_hint
        room_out = req.output_len - req.outputs_guaranteed - 1
        room_ctx = self.cfg.max_model_len - req.num_tokens
        return max(0, min(want, room_out, room_ctx, budget - 1))

    def _allocate_or_preempt(
        self, req: Request, e: Entry, scheduled: set[int], preempted: list[Request]
    ) -> bool:
        total = e.start_pos + e.num_tokens
        while not self.blocks.allocate(req, total):
            victim = self._victim(req, scheduled)
            if victim is None:
                return False
            self._preempt(victim)
            preempted.append(victim)
        return True

    def _victim(self, req: Request, scheduled: set[int]) -> Request | None:
        for cand in reversed(self.running):
            if cand is req or cand.index in scheduled or cand.num_inflight_batches:
                continue
            return cand
        return None

    def _preempt(self, req: Request) -> None:
        self.blocks.release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def admit(self, entries: list[Entry], budget: int) -> int:
        """Admit waiting requests FCFS into `entries` while budget, seats and blocks last
        (blocks allocated; nothing launched); returns the budget left."""
        blocks = self.blocks
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if self._blocked is not None and self.admission_blocked(budget):
                break
            if not req.block_ids:
                # nothing cached: match_prefix would attach no block and return 0. A full
                # cache retries its head request every step (preemption): this keeps it cheap
                cached = blocks.hash_to_block or req.prompt_len < 1
                req.num_cached_tokens = blocks.match_prefix(req) if cached else 0
                req.num_computed_tokens = req.num_cached_tokens
            e = self.plan(req, budget)
            if e is None or not blocks.allocate(req, e.start_pos + e.num_tokens):
                if e is not None:
                    self._blocked = (req, req.num_tokens, blocks.num_free, budget)
                if req.block_ids:
                    blocks.release(req)  # waiting requests hold no blocks (no deadlock)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            entries.append(e)
            budget -= e.num_tokens
        return budget

    def admission_blocked(self, budget: int) -> bool:
        """Whether `admit(entries, budget)` would admit nothing and change nothing because
        its head request's last allocation failed: a full cache retries its head every step.
        True when that failure was with at least as many free blocks, at most this budget (a
        larger budget plans at least as many tokens), the same request and tokens, and no
        cached prefix could match (no hash is registered): then it fails again."""
        if self._blocked is None or not self.waiting or self.blocks.hash_to_block:
            return False
        req, tokens, free, at_most = self._blocked
        return (
            req is self.waiting[0]
            and tokens == req.num_tokens
            and self.blocks.num_free <= free
            and budget >= at_most
        )

    def launch(self, e: Entry) -> None:
        """Advance the entry's request as if its step were launched now (placeholders for
        the tokens it will emit; prompt blocks cached once computed)."""
        req = e.req
        req.num_computed_tokens += e.num_tokens
        req.num_inflight_batches += 1
        if e.generates:
            req.num_placeholders += 1 + e.num_drafts
            req.num_inflight_gen += 1
        if e.is_prefill:
            self.blocks.cache_blocks(req, req.num_computed_tokens)

    @staticmethod
    def shape(entries: Sequence[Entry]) -> BatchShape:
        """The batch's shape, from its requests' counters before `launch`."""
        return BatchShape(*Scheduler.shape_row(entries))

    @staticmethod
    def shape_row(entries: Sequence[Entry]) -> tuple[int, ...]:
        """`shape(entries)`'s fields in SHAPE_FIELDS order, without building the (frozen)
        BatchShape: what the simulator's fast path adds to its own decode sums."""
        n_pf = pf_tok = dec_tok = drafts = kv = pairs = longest = hist = ctx = new = 0
        for e in entries:
            n, s = e.num_tokens, e.start_pos
            r = e.req
            if e.is_prefill:
                n_pf += 1
                pf_tok += n
                if s == r.num_cached_tokens:
                    new += 1
            else:
                dec_tok += n
                drafts += e.num_drafts
            read = s + n  # keys attention reads for this request
            kv += read
            if read > longest:
                longest = read
            pairs += n * s + n * (n + 1) // 2
            if r.needs_history and e.generates:
                hist += r.num_output_tokens + r.num_placeholders
            ctx += r.prompt_len + r.num_output_tokens
        # SHAPE_FIELDS order; finished_reqs is 0 at launch
        return (len(entries), n_pf, pf_tok, dec_tok, drafts, kv, pairs, longest, hist, ctx, new, 0)

    # ---- complete ---------------------------------------------------------------------------
    def complete(self, batch: ScheduledBatch, emitted: Sequence[int]) -> list[Request]:
        """Apply a finished batch. `emitted[i]` = tokens entry i produced before truncation
        (accepted drafts + 1 for generating entries, ignored otherwise). Returns requests that
        finished with this batch; each gets exactly `output_len` tokens."""
        assert not batch.completed, "batch completed twice"
        batch.completed = True
        finished: list[Request] = []
        for e, n_emit in zip(batch.entries, emitted):
            req = e.req
            was_finished = req.status == FINISHED
            self.complete_entry(e, n_emit)
            if req.status == FINISHED:
                if not was_finished:
                    finished.append(req)
                self.release_finished(req)
        return finished

    def complete_entry(self, e: Entry, n_emit: int) -> int:
        """`complete`'s counter updates for one entry of a finished batch (the caller marks
        the batch completed, and calls `release_finished` for a finished request, in entry
        order). Returns the tokens it adds to its request's output (0 for a prompt chunk or a
        request already finished)."""
        req = e.req
        req.num_inflight_batches -= 1
        kept = 0
        if e.generates:
            drafts = e.num_drafts
            assert 1 <= n_emit <= 1 + drafts, f"{req.request_id}: emitted {n_emit}"
            req.num_placeholders -= 1 + drafts
            req.num_inflight_gen -= 1
            if drafts:
                req.num_computed_tokens -= 1 + drafts - n_emit  # rejected drafts' KV
                req.num_accepted_drafts += n_emit - 1
            if req.status != FINISHED:
                left = req.output_len - req.num_output_tokens
                kept = n_emit if n_emit < left else left
                req.num_output_tokens += kept
                if n_emit >= left:
                    self.finish(req)
        return kept

    def release_finished(self, req: Request) -> None:
        """A finished request's blocks go back once no batch in flight holds it; until then
        it is kept (and its blocks counted) as pending. Nothing for one without blocks."""
        if not req.block_ids:
            return
        if req.num_inflight_batches == 0:
            self.blocks.release(req)
            if req in self._pending_free:
                self._pending_free.remove(req)
        elif req not in self._pending_free:
            self._pending_free.append(req)

    def emitted_tokens(self, batch: ScheduledBatch, emitted: Sequence[int]) -> list[int]:
        """Tokens each entry adds to its request's output after truncation (call before
        `complete`): what the engine appends and the sim counts."""
        out = []
        for e, n in zip(batch.entries, emitted):
            if e.generates:
                r = e.req
                left = r.output_len - r.num_output_tokens
                out.append(n if n < left else left)
            else:
                out.append(0)
        return out

    def finish(self, req: Request) -> None:
        """The request has all its outputs: out of the running list."""
        req.status = Status.FINISHED
        self.running.remove(req)

    # ---- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        live = [*self.running, *self.waiting]
        self.blocks.check_invariants(live + self._pending_free)
        for r in self.running:
            assert r.status == Status.RUNNING
            assert 0 <= r.num_computed_tokens <= r.num_tokens, r
            assert r.num_output_tokens <= r.output_len, r
            assert len(r.block_ids) * self.cfg.block_size >= r.num_computed_tokens, r
        for r in self.waiting:
            assert r.status == Status.WAITING and r.num_inflight_batches == 0, r
        assert len(self.running) <= self.cfg.max_num_seqs
