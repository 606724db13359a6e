"""Speculative-decoding steps, fused: the same state changes as the general path, in fewer
Python operations.

With drafts, every entry's accepted count is its own random draw (or n-gram match), so runs of
steps are not alike and `sim.fastforward` does not apply. What costs is the per-entry work of
the general path: `Scheduler.schedule` (`_plan`, `_shape`, `_launch` per entry, properties),
then `AcceptanceModel.emitted`, `Scheduler.emitted_tokens`, `Scheduler.complete` and the
recorder's token calls, each a loop over the batch. `SpecSteps` does each side in one loop on
the real `Request`, `Scheduler` and `BlockManager` objects, so the general path can take over
at any step (nothing is deferred) and replicas fed by a router use it too:

- `schedule()` stands in for `Scheduler.schedule()` when every running request it reaches is
  decoding and the step's new KV blocks fit (no preemption). Decodes are planned exactly as
  `Scheduler._plan` plans them (drafts capped by output room, context room and budget), blocks
  are allocated in running order, then the real `Scheduler._admit` fills the rest of the
  budget; the shape is summed from the same pre-launch counters. Otherwise it returns None
  before changing anything and the caller runs `Scheduler.schedule()`.
- `complete(p)` stands in for `SimLoop.complete_step` with drafts. Per entry, in entry order:
  its accepted drafts (the request's own stream, drawn as `AcceptanceModel.accepted` draws),
  the tokens it keeps (truncated at output_len), its recorded emission, and
  `Scheduler.complete`'s counter updates, finish and block release. A request appears once
  per batch, so fusing the general path's successive loops changes no value; the process-outputs
  phase reads only the batch's shape, so it may run first.
tests/test_sim_fastforward.py runs spec configs with this on and off: equal to the bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core import phases as P
from core.policy import Entry, ScheduledBatch, Scheduler
from core.request import Status
from core.shape import BatchShape

if TYPE_CHECKING:
    from sim.loop import Pass, SimLoop

_RUNNING, _FINISHED = Status.RUNNING, Status.FINISHED


class SpecSteps:
    def __init__(self, loop: SimLoop) -> None:
        self.loop = loop
        cfg = loop.sched.cfg
        self.k = cfg.spec_k
        self.max_len = cfg.max_model_len
        self.max_tokens = cfg.max_num_batched_tokens
        self.max_seqs = cfg.max_num_seqs
        self.block_size = cfg.block_size
        self.num_fast = 0  # steps scheduled here (tests: the path ran)

    def schedule(self) -> ScheduledBatch | None:
        """`Scheduler.schedule()` for a step of decodes (+ admissions) without preemption;
        None (nothing changed) when the general schedule must run."""
        sched = self.loop.sched
        running = sched.running
        k, max_len, bs = self.k, self.max_len, self.block_size
        budget = self.max_tokens
        plan = []
        new_blocks = 0
        for r in running:  # no preemption below: the list does not change while we walk it
            if budget <= 0:
                break
            out = r.num_output_tokens
            g = r.num_inflight_gen
            left = r.output_len - out - g  # Scheduler._plan: outputs_guaranteed < output_len
            if left <= 0:
                continue
            ph = r.num_placeholders
            c = r.num_computed_tokens
            num_tokens = r.prompt_len + out + ph
            if num_tokens - c != 1 or out + ph == 0 or r.status != _RUNNING:
                return None  # not decoding (a prefill chunk to continue)
            hint = r.draft_hint
            d = min(k if hint is None else hint, left - 1, max_len - num_tokens, budget - 1)
            if d < 0:
                d = 0
            n = d + 1
            nb = -(-(c + n) // bs) - len(r.block_ids)
            if nb > 0:
                new_blocks += nb
            plan.append((r, c, n, d, out, ph, nb))
            budget -= n
        if not plan or new_blocks > sched.blocks.num_free:
            return None  # nothing to decode, or a preemption: the general path
        allocate = sched.blocks.allocate
        entries: list[Entry] = []
        append = entries.append
        dec = drafts = kv = pairs = longest = hist = ctx = 0
        for r, c, n, d, out, ph, nb in plan:
            total = c + n
            if nb > 0:
                allocate(r, total)  # fits: new_blocks <= free, allocated in running order
            append(Entry(r, c, n, d, True, False))
            dec += n
            drafts += d
            kv += total
            if total > longest:
                longest = total
            pairs += n * c + n * (n + 1) // 2
            if r.needs_history:
                hist += out + ph
            ctx += r.prompt_len + out
            # Scheduler._launch of a decode
            r.num_computed_tokens = total
            r.num_inflight_batches += 1
            r.num_placeholders = ph + n
            r.num_inflight_gen += 1
        n_pf = pf_tok = new = 0
        if sched.waiting and budget > 0 and len(running) < self.max_seqs:
            admitted: list[Entry] = []
            sched._admit(admitted, budget)
            if admitted:
                s = Scheduler._shape(admitted)  # before their launch, as schedule() takes it
                n_pf, pf_tok, new = s.num_prefill_reqs, s.prefill_tokens, s.new_reqs
                dec += s.decode_tokens
                drafts += s.draft_tokens
                kv += s.kv_read_tokens
                pairs += s.attn_pairs
                if s.max_kv_tokens > longest:
                    longest = s.max_kv_tokens
                hist += s.history_tokens
                ctx += s.context_tokens
                for e in admitted:
                    sched._launch(e)
                entries.extend(admitted)
        shape = BatchShape(
            len(entries), n_pf, pf_tok, dec, drafts, kv, pairs, longest, hist, ctx, new
        )  # SHAPE_FIELDS order
        batch = ScheduledBatch(sched.num_steps, entries, shape, [])
        sched.num_steps += 1
        self.num_fast += 1
        return batch

    def complete(self, p: Pass) -> None:
        """`SimLoop.complete_step(p)` with speculative decoding on."""
        loop = self.loop
        loop._sync(p.step, p.gpu_end_s)
        batch = p.batch
        assert not batch.completed, "batch completed twice"
        batch.completed = True
        t = loop._run_phase(p.step, P.PROCESS_OUTPUTS, batch.shape)
        rec, sched, accept = loop.rec, loop.sched, loop.accept
        rec.gpu(p.step, p.gpu_start_s, p.gpu_end_s)
        tokens = rec.tokens
        ids = accept.token_ids
        streams = accept._streams
        stream = accept.stream
        pending = sched._pending_free
        release = sched.blocks.release
        accepted = 0
        finished = []
        for e in batch.entries:
            r = e.req
            r.num_inflight_batches -= 1
            if e.generates:
                d = e.num_drafts
                a = 0
                if d:
                    i = r.index
                    if ids is not None and ids[i] is not None:
                        a = accept.accepted(r, d)
                    else:  # AcceptanceModel.accepted, inlined
                        got = streams.get(i)
                        draw, rate = got if got is not None else stream(i)
                        while a < d and draw() < rate:
                            a += 1
                    accepted += a
                    r.num_placeholders -= 1 + d
                    r.num_computed_tokens -= d - a  # rejected drafts' KV
                    r.num_accepted_drafts += a
                else:
                    r.num_placeholders -= 1
                r.num_inflight_gen -= 1
                if r.status != _FINISHED:
                    left = r.output_len - r.num_output_tokens
                    if a < left - 1:  # emits a + 1 < left tokens
                        r.num_output_tokens += a + 1
                        tokens(r.index, t, a + 1, a)
                    else:
                        r.num_output_tokens += left
                        tokens(r.index, t, left, a if a < left else left)
                        sched._finish(r)
                        finished.append(r)
            if r.status == _FINISHED and r.block_ids:
                if r.num_inflight_batches == 0:
                    release(r)
                    if r in pending:
                        pending.remove(r)
                elif r not in pending:
                    pending.append(r)
        if accepted:
            rec.accepted(p.step, accepted)
        for r in finished:
            rec.finish(r.index, t)
        if loop._cpu_ngram:
            loop._draft_hints(batch.entries)
        if loop.check:
            sched.check_invariants()
        if loop.progress is not None:
            loop.progress(p.step)
