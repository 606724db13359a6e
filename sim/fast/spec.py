"""Fast-forward with speculative decoding: runs of verify steps in one loop, exactly as the step
loop would run them.

With drafts, each entry's accepted count is its own draw (or n-gram match), so steps are not
alike and the lazy affine members of `sim.fast.decode` do not apply. What this keeps from it
is the shape of the loop: no per-step objects, no recorder or cost-model dispatch per phase,
the CPU clock with its GC pauses and sync waits and the GPU stream as a scalar loop with the
same float operations in the same order as `SimLoop.launch_step` and `SimLoop.complete_step`,
and the recorder fed in bulk at the end. Per entry, the work is done on the real objects:

- launch k: every running request that the passes in flight do not surely finish is decoding
  (checked at the start; only a partial prompt chunk breaks it, and the segment stops after
  the step that admits one). It is planned exactly as `Scheduler.plan` plans a decode
  (drafts capped by output room and context room; the budget cannot cap them: the segment
  runs only while len(running) * (k + 1) <= max_num_batched_tokens), its KV blocks are
  allocated in running order (the segment runs only while every request can take its most,
  so nothing is preempted) and `Scheduler.launch` advances its counters; the real
  `Scheduler.admit` then fills the budget left, as `Scheduler.schedule` does.
- the completion of the oldest pass: per entry, in entry order, its accepted drafts (the
  request's own stream, or `AcceptanceModel.accepted` with token ids), the tokens it keeps,
  and `Scheduler.complete`'s counter updates, finishes and block releases (see
  `SimLoop.complete_step`, which does the same per entry).
The segment ends before a step the normal path must run (nothing to decode, a budget or
block shortage) or after one that admitted a partial prompt chunk; at the end the passes
still in flight are handed back as `Pass` objects. tests/test_sim_fastforward.py checks that
runs with it on and off are equal to the bit.
"""

from __future__ import annotations

from array import array
from bisect import insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bubblesim.core.policy import Entry, ScheduledBatch, Scheduler
from bubblesim.core.request import Request, Status
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape
from sim.clock import (
    GPU_COUNTS,
    GPU_END,
    NO_EVENT,
    PO1,
    PO_OBJS,
    PO_S,
    Pass,
    Times,
    launched_pass,
)
from sim.fast.bulk import last_completed, record_steps, times_matrix
from sim.fast.decode import MAX_SEGMENT_STEPS
from sim.fast.host import Host
from sim.stepcosts import StepShape

_FINISHED = Status.FINISHED


class _Member:
    """A request of the segment's running set. Individual members live in their `Request`
    (planned and completed as `Scheduler` would). A steady member is in rhythm: launched at
    every step with k drafts, so before each launch its passes in flight are the last
    nd = depth - 1 launches, each with k drafts, and its state is implied by `out`:
    placeholders = inflight_gen * (k + 1), inflight_gen = inflight batches = nd, computed =
    prompt + out + placeholders - 1 (the Request's counters are stale until written back).
    It stays steady while out <= `tail` (the next launch plans k drafts: output and context
    room) and its blocks hold the next launch; `ev` is the out at which one of them fails."""

    __slots__ = ("req", "key", "row", "prompt", "output_len", "hist", "tail", "steady", "out",
                 "acc", "ev", "draw", "rate")  # fmt: skip

    def __init__(self, req: Request, key: int, k: int, nd: int, max_len: int) -> None:
        self.req = req
        self.key = key  # order in the running list (entry order in a batch)
        self.row = req.index
        self.prompt = req.prompt_len
        self.output_len = req.output_len
        self.hist = req.needs_history
        ph = nd * (k + 1)
        self.tail = min(req.output_len - k - nd - 1, max_len - k - req.prompt_len - ph)
        self.steady = False
        self.out = 0  # confirmed outputs (steady only)
        self.acc = 0  # accepted drafts not yet written back (steady only)
        self.ev = 0
        self.draw: Callable[[], float] | None = None
        self.rate = 0.0


def _key(m: _Member) -> int:
    return m.key


class _Steady:
    """The steady members in key order, and the sums a launch's shape needs from them.
    `top` is the largest prompt + out among them (0 with none): whoever raises a member's
    `out` raises `top` with it."""

    __slots__ = ("members", "prompt", "out", "out_h", "n_h", "top")

    def __init__(self) -> None:
        self.members: list[_Member] = []
        self.prompt = self.out = self.out_h = self.n_h = self.top = 0

    def add(self, m: _Member) -> None:
        insort(self.members, m, key=_key)
        self.prompt += m.prompt
        self.out += m.out
        if m.hist:
            self.out_h += m.out
            self.n_h += 1
        if m.prompt + m.out > self.top:
            self.top = m.prompt + m.out

    def remove(self, m: _Member) -> None:
        self.members.remove(m)
        self.prompt -= m.prompt
        self.out -= m.out
        if m.hist:
            self.out_h -= m.out
            self.n_h -= 1
        if m.prompt + m.out >= self.top:  # it may have been the longest: look again
            self.top = max([x.prompt + x.out for x in self.members], default=0)


def _ints() -> array[int]:
    return array("q")


@dataclass
class _Run:
    """What a segment computed: per launch k, and per iteration (the pass completed in it)."""

    n: int = 0
    rows: list[int] = field(default_factory=list)  # shape of launch k: SHAPE_FIELDS values
    # batch of launch k: steady members (k drafts each), then individual and admitted entries
    passes: list[tuple[list[_Member], list[Entry]]] = field(default_factory=list)
    launches: list[Times] = field(default_factory=list)  # StepClock.step of iteration k
    # process_outputs seconds and objects of the pass completed in iteration i
    po_s: list[float] = field(default_factory=list)
    po_objs: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # per iteration: drafts accepted
    emitted: list[int] = field(default_factory=list)  # per iteration: emissions recorded
    tok_rows: array[int] = field(default_factory=_ints)  # per emission
    tok_n: array[int] = field(default_factory=_ints)
    tok_acc: array[int] = field(default_factory=_ints)


class SpecForward:
    def __init__(self, loop: Host) -> None:
        self.loop = loop
        cfg = loop.sched.cfg
        self.k = cfg.spec_k
        self.max_len = cfg.max_model_len
        self.max_seqs = cfg.max_num_seqs
        self.max_tokens = cfg.max_num_batched_tokens
        self.block_size = cfg.block_size
        # a decode of at most k + 1 tokens from a position its blocks cover needs at most this
        self.blocks_per_decode = -(-(self.k + 1) // cfg.block_size)
        self.num_segments = 0
        self.num_steps = 0

    def run_segment(self) -> bool:
        """Run a segment from the loop's current state; False (nothing done) if none applies."""
        loop = self.loop
        running = loop.sched.running
        nd = loop.depth - 1
        if not running or len(loop.inflight) != nd:
            return False
        bs = self.block_size
        for r in running:
            if r.outputs_guaranteed >= r.output_len:
                continue  # the passes in flight finish it: never scheduled again
            if not r.in_decode:
                return False  # a prompt chunk to continue
            if len(r.block_ids) * bs < r.num_computed_tokens:
                return False  # fewer blocks than computed tokens: not ours to model
        seg = _Segment(self, list(loop.inflight))
        run = seg.simulate()
        if run.n == 0:
            return False  # nothing changed: the first step already needs the normal path
        seg.record()
        seg.write_back()
        self.num_segments += 1
        self.num_steps += run.n
        return True


class _Segment:
    """One segment's state: the members, the passes, what is recorded at the end."""

    def __init__(self, ff: SpecForward, old: list[Pass]) -> None:
        self.ff = ff
        self.loop = loop = ff.loop
        self.old = old
        self.run = _Run()
        self.k = ff.k
        self.nd = nd = len(old)
        self.ph = nd * (ff.k + 1)  # a steady member's placeholders before a launch
        accept = loop.accept
        self.ids = accept.token_ids
        self.steady_ok = self.ids is None  # with token ids, acceptance reads the Request
        self.wait_counts = loop.wait_for_counts and nd > 0  # prep waits for the last counts
        self.steady = _Steady()
        self.members: dict[int, _Member] = {}  # by request row
        self.individual: list[_Member] = []  # key order
        self.grow_next: list[_Member] = []  # steady members needing a block at the next launch
        self.fin: list[tuple[int, Request]] = []  # finished with blocks, this completion
        for r in loop.sched.running:
            self._join(r)

    def _join(self, r: Request) -> _Member:
        ff = self.ff
        m = _Member(r, len(self.members), ff.k, self.nd, ff.max_len)
        if self.steady_ok:
            m.draw, m.rate = self.loop.accept.stream(r.index)
        self.members[r.index] = m
        self.individual.append(m)  # keys grow with admission: the list stays in key order
        return m

    def _set_ev(self, m: _Member) -> None:
        """The out at which a steady member must leave the fast path (tail or a new block)."""
        cap = len(m.req.block_ids) * self.ff.block_size
        m.ev = min(m.tail, cap - m.prompt - self.ph - self.k) + 1

    def _write_steady(self, m: _Member, out: int, c_out: int) -> None:
        """A steady member's counters into its Request (after a completion, or at the end):
        `out` confirmed outputs, computed as if out were `c_out` (they differ when the last
        emission was truncated at output_len)."""
        r, nd = m.req, self.nd
        r.num_output_tokens = out
        r.num_placeholders = self.ph
        r.num_inflight_gen = r.num_inflight_batches = nd
        r.num_computed_tokens = m.prompt + c_out + self.ph - 1
        r.num_accepted_drafts += m.acc
        m.acc = 0

    # ---- completions off the hot path ---------------------------------------------------------
    def steady_event(self, m: _Member, a: int, t: float) -> None:
        """A steady member's completion with `a` accepted drafts reached `m.ev`: record it
        and finish the request, leave the fast path, or ask for a block."""
        run, st, r = self.run, self.steady, m.req
        out0 = m.out
        o = out0 + 1 + a
        left = m.output_len - out0
        run.tok_rows.append(m.row)
        m.acc += a
        if o >= m.output_len:  # emits `left` tokens and finishes
            run.tok_n.append(left)
            run.tok_acc.append(a if a < left else left)
            st.remove(m)
            m.steady = False
            m.out = m.output_len
            self._write_steady(m, m.output_len, o)
            loop = self.loop
            loop.sched.finish(r)
            loop.rec.finish(m.row, t)
            if r.block_ids:
                self.fin.append((m.key, r))
            return
        run.tok_n.append(1 + a)
        run.tok_acc.append(a)
        st.out += 1 + a
        if m.hist:
            st.out_h += 1 + a
        m.out = o
        if m.prompt + o > st.top:
            st.top = m.prompt + o
        if o > m.tail:  # the next launch plans fewer drafts: individual from now on
            st.remove(m)
            m.steady = False
            self._write_steady(m, o, o)
            insort(self.individual, m, key=_key)
        else:
            self.grow_next.append(m)  # o > the block threshold: allocated at the next launch

    def complete_entry(self, e: Entry, t: float) -> tuple[int, int]:
        """One entry of a completing batch, dispatched on its request's mode; returns
        (accepted drafts, emissions recorded)."""
        m = self.members.get(e.req.index)
        if m is not None and m.steady:
            assert e.num_drafts == self.k and e.generates, e
            a = 0
            draw, rate = m.draw, m.rate
            assert draw is not None
            while a < self.k and draw() < rate:
                a += 1
            o = m.out + 1 + a
            if o < m.ev:
                run, st = self.run, self.steady
                m.out = o
                m.acc += a
                st.out += 1 + a
                if m.hist:
                    st.out_h += 1 + a
                if m.prompt + o > st.top:
                    st.top = m.prompt + o
                run.tok_rows.append(m.row)
                run.tok_n.append(1 + a)
                run.tok_acc.append(a)
            else:
                self.steady_event(m, a, t)
            return a, 1
        return self.complete_general(e, t)

    def complete_general(self, e: Entry, t: float) -> tuple[int, int]:
        """One entry of an individual request, as the step loop completes it: its accepted
        drafts, `Scheduler.complete_entry`, its recorded tokens (blocks: `settle`). Returns
        (accepted drafts, emissions recorded)."""
        r = e.req
        loop = self.loop
        a = loop.accept.accepted(r, e.num_drafts) if e.num_drafts and e.generates else 0
        was_finished = r.status == _FINISHED
        kept = loop.sched.complete_entry(e, 1 + a)
        emitted = 0
        if kept:
            run = self.run
            run.tok_rows.append(r.index)
            run.tok_n.append(kept)
            run.tok_acc.append(a if a < kept else kept)
            emitted = 1
        if r.status == _FINISHED:
            if not was_finished:
                loop.rec.finish(r.index, t)
            if r.block_ids:
                m = self.members.get(r.index)
                self.fin.append((m.key if m is not None else -1, r))
        return a, emitted

    def settle(self) -> None:
        """Finished requests of this completion: blocks back in entry order (Scheduler.complete
        releases them as it walks the batch), or kept while a batch in flight holds them."""
        fin = self.fin
        if len(fin) > 1:
            fin.sort(key=_first)
        release = self.loop.sched.release_finished
        for _, r in fin:
            release(r)
        fin.clear()

    # ---- the steps ----------------------------------------------------------------------------
    def simulate(self) -> _Run:
        """SimLoop.launch_step + complete_step, iteration after iteration (see the module
        docstring); each step's timing is sim.clock.StepClock's."""
        loop, ff, run, old = self.loop, self.ff, self.run, self.old
        sched, rec, costs, clock = loop.sched, loop.rec, loop.costs, loop.clock
        blocks = sched.blocks
        allocate = blocks.allocate
        num_drafts, launch_entry = sched.num_drafts, sched.launch
        running, waiting = sched.running, sched.waiting
        tick_at_s = loop.tick_at_s
        K, max_tokens = ff.k, ff.max_tokens
        max_seqs, bs, bpd = ff.max_seqs, ff.block_size, ff.blocks_per_decode
        Kp = K + 1
        tri = Kp * (Kp + 1) // 2  # attention pairs of a k + 1 token decode, past its start
        nd, ph_s = self.nd, self.ph
        st, grow_next = self.steady, self.grow_next
        s0 = rec.num_steps
        rows, passes = run.rows, run.passes
        launches, po_s, po_objs = run.launches, run.po_s, run.po_objs
        clock_step = clock.step
        acc_per_it, emitted_per_it = run.accepted, run.emitted
        tok_rows, tok_n, tok_acc = run.tok_rows, run.tok_n, run.tok_acc
        steady_ok = self.steady_ok
        hints = loop.cpu_ngram and self.ids is not None
        wait_counts = self.wait_counts
        complete_entry, steady_event, settle = self.complete_entry, self.steady_event, self.settle
        join, set_ev = self._join, self._set_ev

        sh, mx = StepShape(), StepShape()  # this verify step's shape; a step with prompts'
        sh.set_verify(1, 1, 0)
        c: list[Any] = []  # the step's costs (sim.clock.COSTS)
        varying: list[Any] = []  # how to get those that vary: StepCosts.varying
        # the passes completed in iterations 0 .. nd - 1: the old ones
        po_s.extend(p.po_s for p in old)
        po_objs.extend(p.po_objs for p in old)
        old_step = [p.step for p in old]
        old_end = [p.gpu_end_s for p in old]
        last_counts = old[-1].counts_s if old else 0.0
        for p in old:
            assert not p.batch.completed, "batch completed twice"
        no_members: list[_Member] = []
        next_arrival_s = loop.next_arrival_s()
        cpu = clock.cpu_s
        no_entries: list[Entry] = []  # never appended to
        reload = True
        last_b = last_dec = last_drafts = -1
        stop_after = False
        k = 0
        while k < MAX_SEGMENT_STEPS and not stop_after:
            # ---- top of the loop: arrivals up to the CPU clock are visible
            if next_arrival_s <= cpu:
                next_arrival_s = loop.take_arrivals()
            # ---- schedule(): the decodes (Scheduler.plan, allocation, launch)
            nr = len(running)
            if nr * Kp > max_tokens or blocks.num_free < nr * bpd:
                break  # the budget could cap drafts, or a request could need preemption
            needs: list[tuple[int, Request, int, _Member | None]] | None = None
            ents = no_entries  # shared while empty: a pass's own list once it has one
            dec = drafts = kv = pairs = longest = hist = ctx = 0
            if self.individual:
                needs = []
                ents = []
                keep = []
                for m in self.individual:
                    r = m.req
                    out = r.num_output_tokens
                    g = r.num_inflight_gen
                    left = m.output_len - out - g
                    if left <= 0:  # Scheduler.plan: outputs_guaranteed >= output_len
                        continue  # batches in flight will finish it: never scheduled again
                    ph = r.num_placeholders
                    computed = r.num_computed_tokens
                    if (
                        steady_ok and g == nd and ph == ph_s and out <= m.tail
                        and r.num_inflight_batches == nd and r.draft_hint is None
                    ):  # fmt: skip
                        m.steady = True  # in rhythm, and k drafts at this launch: steady
                        m.out = out
                        st.add(m)
                        if computed + Kp > len(r.block_ids) * bs:
                            needs.append((m.key, r, computed + Kp, m))
                        else:
                            set_ev(m)
                        continue
                    keep.append(m)
                    # Scheduler.plan of a decode; the budget cannot cap its drafts here (the
                    # segment runs only while len(running) * (k + 1) <= max_num_batched_tokens)
                    d = num_drafts(r, max_tokens)
                    total = computed + d + 1
                    if total > len(r.block_ids) * bs:
                        needs.append((m.key, r, total, None))
                    ents.append(Entry(r, computed, d + 1, d, True, False))
                self.individual = keep
                if ents:
                    ps = Scheduler.shape(ents)  # before their launch, as schedule() takes it
                    dec, drafts, kv = ps.decode_tokens, ps.draft_tokens, ps.kv_read_tokens
                    pairs, longest = ps.attn_pairs, ps.max_kv_tokens
                    hist, ctx = ps.history_tokens, ps.context_tokens
                    for e in ents:
                        launch_entry(e)
            b_s = len(st.members)
            if not b_s and not ents:
                break  # nothing to decode (nothing changed): the normal path
            # allocations in running order, as schedule() makes them; they fit: num_free >=
            # nr * blocks_per_decode. A steady member's next block moves its `ev`.
            if grow_next and not needs and len(grow_next) == 1:
                m = grow_next.pop()
                r = m.req
                allocate(r, m.prompt + m.out + ph_s + K)
                ev = len(r.block_ids) * bs - m.prompt - ph_s - K
                m.ev = (m.tail if m.tail < ev else ev) + 1
            elif grow_next or needs:
                if needs is None:
                    needs = []
                for m in grow_next:
                    needs.append((m.key, m.req, m.prompt + m.out + ph_s + K, m))
                grow_next.clear()
                if len(needs) > 1:
                    needs.sort(key=_first)
                for _, r, total, mm in needs:
                    allocate(r, total)
                    if mm is not None:
                        set_ev(mm)
            if b_s:
                snap = st.members[:]
                c_sum = st.prompt + st.out + b_s * (ph_s - 1)  # their computed tokens
                dec += b_s * Kp
                drafts += b_s * K
                kv += c_sum + b_s * Kp
                pairs += Kp * c_sum + b_s * tri
                if st.top + ph_s + K > longest:  # reads its computed tokens + k + 1
                    longest = st.top + ph_s + K
                hist += st.out_h + st.n_h * ph_s
                ctx += st.prompt + st.out
            else:
                snap = no_members
            b = b_s + len(ents)
            budget = max_tokens - dec
            admitted = no_entries
            if waiting and budget > 0 and len(running) < max_seqs:
                admitted = []
                sched.admit(admitted, budget)
                if len(running) > loop.peak_running:
                    loop.peak_running = len(running)
            if admitted:
                pf = Scheduler.shape(admitted)  # before their launch, as schedule() takes it
                for e in admitted:
                    launch_entry(e)
                    join(e.req)
                    if not e.generates:
                        stop_after = True  # a partial prompt chunk: the normal path goes on
                ents = ents + admitted
                row = (
                    b + len(admitted), pf.num_prefill_reqs, pf.prefill_tokens,
                    dec + pf.decode_tokens, drafts + pf.draft_tokens, kv + pf.kv_read_tokens,
                    pairs + pf.attn_pairs, max(longest, pf.max_kv_tokens),
                    hist + pf.history_tokens, ctx + pf.context_tokens, pf.new_reqs, 0,
                )  # fmt: skip
                mx.set_row(row)
                c = costs.all(mx)
                reload = True  # the next verify step takes its constants again
            else:
                row = (b, 0, 0, dec, drafts, kv, pairs, longest, hist, ctx, 0, 0)
                if reload or b != last_b or dec != last_dec or drafts != last_drafts:
                    # the constant fields of a verify step (sh is one from the start)
                    sh.num_reqs = b
                    sh.decode_tokens = sh.num_tokens = dec
                    sh.draft_tokens = drafts
                    key = (b, dec, drafts)
                    c = list(costs.const(sh, key))
                    varying = costs.varying(key)
                    last_b, last_dec, last_drafts = b, dec, drafts
                    reload = False
                sh.kv_read_tokens = kv
                sh.attn_pairs = pairs
                sh.max_kv_tokens = longest
                sh.history_tokens = hist
                sh.context_tokens = ctx
                for i, fn, ms in varying:  # StepCosts.varying
                    c[i] = fn(sh) / 1e3 if ms else fn(sh)
            rows += row
            passes.append((snap, ents))
            step = s0 + k
            # ---- launch_step, then complete_step of the oldest pass in flight
            counts_s = NO_EVENT
            if wait_counts:  # spec decoding before PR 32951: prep waits for the last counts
                counts_s = launches[k - 1][GPU_COUNTS] if k else last_counts
            po_s.append(c[PO_S])
            po_objs.append(c[PO_OBJS])
            if k >= nd:  # the pass launched nd iterations ago (nd = 0: the one launched now)
                t = clock_step(
                    step, c, counts_s, step - nd, launches[k - nd][GPU_END] if nd else None,
                    po_s[k], po_objs[k],
                )  # fmt: skip
            else:  # an old pass
                t = clock_step(step, c, counts_s, old_step[k], old_end[k], po_s[k], po_objs[k])
            launches.append(t)
            cpu = t[PO1]
            if cpu >= tick_at_s:
                stop_after = True  # the progress hook looks now (sim.loop.SimLoop.tick_at_s)
            # accept.emitted + sched.emitted_tokens + sched.complete + tokens, per entry
            accepted = emitted = 0
            if k < nd:  # an old pass: entry by entry, blocks released as Scheduler does
                batch = old[k].batch
                batch.completed = True
                for e in batch.entries:
                    x, y = complete_entry(e, cpu)
                    accepted += x
                    emitted += y
                    settle()
                if hints:
                    loop.draft_hints(batch.entries)
            else:
                snap, ents = passes[k - nd]
                passes[k - nd] = (no_members, ents)  # completed: its members are not needed
                d_out = d_out_h = top = 0  # top: the largest prompt + out raised here
                emitted = len(snap)  # one emission each, but for those no longer steady
                for m in snap:
                    if m.steady:  # the hot path: k drafts, and out stays at most `tail`
                        a = 0
                        draw, rate = m.draw, m.rate
                        while a < K and draw() < rate:  # type: ignore[misc]
                            a += 1
                        accepted += a
                        n = 1 + a
                        o = m.out + n
                        if o >= m.ev:
                            if o > m.tail:
                                steady_event(m, a, cpu)
                                continue
                            grow_next.append(m)  # the next launch writes past its blocks
                        m.out = o
                        o += m.prompt  # its prompt + out, for the batch's longest
                        if o > top:
                            top = o
                        m.acc += a
                        d_out += n
                        if m.hist:
                            d_out_h += n
                        tok_rows.append(m.row)
                        tok_n.append(n)
                        tok_acc.append(a)
                    else:  # left the fast path after this launch
                        x, y = self.complete_general(Entry(m.req, 0, Kp, K, True, False), cpu)
                        accepted += x
                        emitted += y - 1
                st.out += d_out
                st.out_h += d_out_h
                if top > st.top:  # members raised here stay steady through the loop
                    st.top = top
                for e in ents:
                    x, y = complete_entry(e, cpu)
                    accepted += x
                    emitted += y
                if self.fin:
                    settle()
                if hints:
                    loop.draft_hints(ents)
            acc_per_it.append(accepted)
            emitted_per_it.append(emitted)
            k += 1
        run.n = k
        sched.num_steps += k
        return run

    # ---- bulk bookkeeping ---------------------------------------------------------------------
    def record(self) -> None:
        loop, run, old = self.loop, self.run, self.old
        rec = loop.rec
        n, nd = run.n, self.nd
        shapes = np.fromiter(run.rows, np.int64, len(run.rows)).reshape(n, len(SHAPE_FIELDS))
        s0, po1 = record_steps(rec, loop.clock, old, shapes, times_matrix(run.launches))
        for k, p in enumerate(old[:n]):
            if run.accepted[k]:
                rec.accepted(p.step, run.accepted[k])
        if n > nd:
            rec.accepted_many(s0, run.accepted[nd:n])
        times = np.repeat(np.frombuffer(po1, np.float64)[:n], run.emitted)
        rec.tokens_many(
            np.frombuffer(run.tok_rows, np.int64), times,
            np.frombuffer(run.tok_n, np.int64), np.frombuffer(run.tok_acc, np.int64),
        )  # fmt: skip
        if loop.progress is not None:
            loop.progress(last_completed(s0, old, n))

    def write_back(self) -> None:
        """Steady members' counters into their Requests, and the passes still in flight back
        to the loop as the step-by-step path has them."""
        loop, run, old = self.loop, self.run, self.old
        n, nd, K = run.n, self.nd, self.k
        for m in self.steady.members:
            self._write_steady(m, m.out, m.out)
        inflight: deque[Pass] = deque(old[n:])
        s0 = loop.rec.num_steps - n
        first = loop.sched.num_steps - n  # the batch index of launch 0
        # outputs confirmed after launch k, per request row, for the launches still in flight
        later: dict[int, int] = {}
        tok_rows, tok_n, emitted = run.tok_rows, run.tok_n, run.emitted
        j = len(tok_rows)
        members = self.members
        for k in range(n - 1, max(0, n - nd) - 1, -1):
            for i in range(j - emitted[k], j):  # emissions of iteration k, after launch k
                later[tok_rows[i]] = later.get(tok_rows[i], 0) + tok_n[i]
            j -= emitted[k]
            snap, ents = run.passes[k]
            entries = list(ents)
            for m in snap:
                r = m.req
                out_k = r.num_output_tokens - later.get(m.row, 0)
                entries.append(Entry(r, m.prompt + out_k + self.ph - 1, K + 1, K, True, False))
            if snap:
                entries.sort(key=lambda e: members[e.req.index].key)
            w = len(SHAPE_FIELDS)
            batch = ScheduledBatch(first + k, entries, BatchShape(*run.rows[k * w : (k + 1) * w]))
            po = run.po_s[nd + k], run.po_objs[nd + k]
            inflight.append(launched_pass(batch, s0 + k, run.launches[k], po))
        loop.inflight = deque(sorted(inflight, key=lambda p: p.step))
        if loop.check:
            loop.sched.check_invariants()


def _first(x: tuple[Any, ...]) -> Any:
    return x[0]
