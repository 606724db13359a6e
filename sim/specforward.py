"""Fast-forward with speculative decoding: runs of verify steps in one loop, exactly as the step
loop would run them.

With drafts, each entry's accepted count is its own draw (or n-gram match), so steps are not
alike and the lazy affine members of `sim.fastforward` do not apply. What this keeps from it
is the shape of the loop: no per-step objects, no recorder or cost-model dispatch per phase,
the CPU clock with its GC pauses and sync waits and the GPU stream as a scalar loop with the
same float operations in the same order as `SimLoop.launch_step` and `SimLoop.complete_step`,
and the recorder fed in bulk at the end. Per entry, the work is done on the real objects:

- launch k: every running request that the passes in flight do not surely finish is decoding
  (checked at the start; only a partial prompt chunk breaks it, and the segment stops after
  the step that admits one). It is planned exactly as `Scheduler._plan` plans a decode
  (drafts capped by output room and context room; the budget cannot cap them: the segment
  runs only while len(running) * (k + 1) <= max_num_batched_tokens), its KV blocks are
  allocated in running order (the segment runs only while every request can take its most,
  so nothing is preempted) and `Scheduler._launch`'s counters advance; the real
  `Scheduler._admit` then fills the budget left, as `Scheduler.schedule` does.
- the completion of the oldest pass: per entry, in entry order, its accepted drafts (the
  request's own stream, or `AcceptanceModel.accepted` with token ids), the tokens it keeps,
  and `Scheduler.complete`'s counter updates, finishes and block releases (see
  sim/specstep.py: fusing the general path's loops over one batch changes no value).
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
from typing import TYPE_CHECKING, Any

import numpy as np

from core import phases as P
from core.policy import Entry, ScheduledBatch, Scheduler
from core.request import Request, Status
from core.shape import SHAPE_FIELDS, BatchShape
from sim.fastforward import MAX_SEGMENT_STEPS, _Costs, _Shape, quick_costs

if TYPE_CHECKING:
    from sim.loop import Pass, SimLoop

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


def _times() -> array[float]:
    return array("d")


def _ints() -> array[int]:
    return array("q")


@dataclass
class _Run:
    """What a segment computed: per launch k, and per iteration (the pass completed in it)."""

    n: int = 0
    rows: list[int] = field(default_factory=list)  # shape of launch k: SHAPE_FIELDS values
    # batch of launch k: steady members (k drafts each), then individual and admitted entries
    passes: list[tuple[list[_Member], list[Entry]]] = field(default_factory=list)
    sched0: array[float] = field(default_factory=_times)
    sched1: array[float] = field(default_factory=_times)
    prep0: array[float] = field(default_factory=_times)  # after a wait for accepted counts
    prep1: array[float] = field(default_factory=_times)
    launch1: array[float] = field(default_factory=_times)
    sample1: array[float] = field(default_factory=_times)
    draft0: array[float] = field(default_factory=_times)  # after the CPU proposer's sync
    draft1: array[float] = field(default_factory=_times)
    gpu_start: array[float] = field(default_factory=_times)
    gpu_counts: array[float] = field(default_factory=_times)
    gpu_end: array[float] = field(default_factory=_times)
    po0: array[float] = field(default_factory=_times)  # per iteration
    po1: array[float] = field(default_factory=_times)
    accepted: list[int] = field(default_factory=list)  # per iteration: drafts accepted
    emitted: list[int] = field(default_factory=list)  # per iteration: emissions recorded
    sync_step: array[int] = field(default_factory=_ints)
    sync0: array[float] = field(default_factory=_times)
    sync1: array[float] = field(default_factory=_times)
    pauses: list[tuple[float, float, int, str, int]] = field(default_factory=list)
    tok_rows: array[int] = field(default_factory=_ints)  # per emission
    tok_n: array[int] = field(default_factory=_ints)
    tok_acc: array[int] = field(default_factory=_ints)


class SpecForward:
    def __init__(self, loop: SimLoop) -> None:
        self.loop = loop
        cfg = loop.sched.cfg
        self.k = cfg.spec_k
        self.max_len = cfg.max_model_len
        self.max_seqs = cfg.max_num_seqs
        self.max_tokens = cfg.max_num_batched_tokens
        self.block_size = cfg.block_size
        # a decode of at most k + 1 tokens from a position its blocks cover needs at most this
        self.blocks_per_decode = -(-(self.k + 1) // cfg.block_size)
        self.costs = _Costs(loop)
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
            out, ph = r.num_output_tokens, r.num_placeholders
            if r.output_len - out - r.num_inflight_gen <= 0:
                continue  # the passes in flight finish it: never scheduled again
            if r.prompt_len + out + ph - r.num_computed_tokens != 1 or out + ph == 0:
                return False  # not decoding
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
        self.wait_counts = loop._wait_for_counts and nd > 0  # prep waits for the last counts
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
            loop.sched._finish(r)
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
        return self.complete_general(e.req, e.num_drafts, e.generates, t)

    def complete_general(self, r: Request, d: int, gen: bool, t: float) -> tuple[int, int]:
        """Scheduler.complete for one entry of an individual request (+ its accepted drafts
        and recorded tokens), exactly as the step loop does it."""
        r.num_inflight_batches -= 1
        a = emitted = 0
        if gen:
            if d:
                ids = self.ids
                if ids is not None and ids[r.index] is not None:
                    a = self.loop.accept.accepted(r, d)
                else:
                    draw, rate = self.loop.accept.stream(r.index)
                    while a < d and draw() < rate:
                        a += 1
                r.num_placeholders -= 1 + d
                r.num_computed_tokens -= d - a  # rejected drafts' KV
                r.num_accepted_drafts += a
            else:
                r.num_placeholders -= 1
            r.num_inflight_gen -= 1
            if r.status != _FINISHED:
                run = self.run
                left = r.output_len - r.num_output_tokens
                run.tok_rows.append(r.index)
                emitted = 1
                if a < left - 1:  # emits a + 1 < left tokens
                    r.num_output_tokens += a + 1
                    run.tok_n.append(a + 1)
                    run.tok_acc.append(a)
                else:
                    r.num_output_tokens += left
                    run.tok_n.append(left)
                    run.tok_acc.append(a if a < left else left)
                    self.loop.sched._finish(r)
                    self.loop.rec.finish(r.index, t)
        if r.status == _FINISHED and r.block_ids:
            m = self.members.get(r.index)
            self.fin.append((m.key if m is not None else -1, r))
        return a, emitted

    def settle(self) -> None:
        """Finished requests of this completion: blocks back in entry order (Scheduler.complete
        releases them as it walks the batch), or kept while a batch in flight holds them."""
        fin = self.fin
        if len(fin) > 1:
            fin.sort(key=_first)
        sched = self.loop.sched
        pending = sched._pending_free
        for _, r in fin:
            if r.num_inflight_batches == 0:
                sched.blocks.release(r)
                if r in pending:
                    pending.remove(r)
            elif r not in pending:
                pending.append(r)
        fin.clear()

    # ---- the steps ----------------------------------------------------------------------------
    def simulate(self) -> _Run:
        """SimLoop.launch_step + complete_step, iteration after iteration (see the module
        docstring). The phase blocks are unrolled as in sim/fastforward.py."""
        loop, ff, run, old = self.loop, self.ff, self.run, self.old
        sched, gc, rec, costs = loop.sched, loop.gc, loop.rec, ff.costs
        blocks = sched.blocks
        allocate = blocks.allocate
        running, waiting = sched.running, sched.waiting
        gc_allocate = gc.allocate
        gc_on, gc_t0 = gc.enabled, gc.t0
        tick_at_s = loop.tick_at_s
        K, max_len, max_tokens = ff.k, ff.max_len, ff.max_tokens
        max_seqs, bs, bpd = ff.max_seqs, ff.block_size, ff.blocks_per_decode
        Kp = K + 1
        tri = Kp * (Kp + 1) // 2  # attention pairs of a k + 1 token decode, past its start
        nd, ph_s = self.nd, self.ph
        st, grow_next = self.steady, self.grow_next
        s0 = rec.num_steps
        rows, passes = run.rows, run.passes
        sched0, sched1, prep0, prep1 = run.sched0, run.sched1, run.prep0, run.prep1
        launch1, sample1, draft0, draft1 = run.launch1, run.sample1, run.draft0, run.draft1
        g_start, g_counts, g_end = run.gpu_start, run.gpu_counts, run.gpu_end
        po0, po1, pauses = run.po0, run.po1, run.pauses
        sync_step, sync0, sync1 = run.sync_step, run.sync0, run.sync1
        acc_per_it, emitted_per_it = run.accepted, run.emitted
        tok_rows, tok_n, tok_acc = run.tok_rows, run.tok_n, run.tok_acc
        pause_at = pauses.append
        steady_ok = self.steady_ok
        hints = loop._cpu_ngram and self.ids is not None
        wait_counts = self.wait_counts
        cpu_ngram = loop._cpu_ngram
        complete_entry, steady_event, settle = self.complete_entry, self.steady_event, self.settle
        join, set_ev = self._join, self._set_ev

        sh, mx = _Shape(), _Shape()
        sh.set_verify(1, 1, 0)
        fns = costs.decode_fns  # any value they give is taken from `const` for other shapes
        f_sched, f_prep, f_launch, f_sample, f_draft, f_po, f_gpu, f_dgpu = fns[:8]
        fa_sched, fa_prep, fa_launch, fa_sample, fa_draft, fa_po, f_graph = fns[8:]
        # process_outputs of the pass completed in iteration i: old passes, then launch i - nd
        po_s = [loop.cost.cpu_phase_ms(P.PROCESS_OUTPUTS, p.batch.shape) / 1e3 for p in old]
        po_a = [loop.cost.alloc_objects(P.PROCESS_OUTPUTS, p.batch.shape) for p in old]
        old_step = [p.step for p in old]
        # the CPU spread (sim.cost.spread): per-step multipliers, read from its window; the
        # quick block assumes constant phase times, so with a spread only the general one runs
        spread = loop.spread
        m_sched = m_prep = m_launch = m_sample = m_draft = m_po = 1.0
        w_sched = w_prep = w_launch = w_sample = w_draft = w_po = [1.0]
        jlo = 0
        if spread is not None:
            spread.ensure(min([s0, *old_step]), s0 + MAX_SEGMENT_STEPS)
            w_sched, w_prep, w_launch, w_sample, w_draft, w_po = spread.window
            jlo = spread.lo
            po_s = [x * w_po[st - jlo] for x, st in zip(po_s, old_step)]
        old_end = [p.gpu_end_s for p in old]
        last_counts = old[-1].counts_s if old else 0.0
        for p in old:
            assert not p.batch.completed, "batch completed twice"
        no_members: list[_Member] = []
        next_arrival_s = loop.next_arrival_s()
        cpu, gpu_free = loop.cpu_s, loop.gpu_free_s
        idle_scale, idle_min_s = loop.cost.idle_start_scale, loop.cost.idle_start_min_s
        wake = loop.cost.sync_wake_s  # a host wait ends this long after its event
        no_entries: list[Entry] = []  # never appended to
        reload = True
        last_b = last_dec = last_drafts = -1
        stop_after = False
        k = 0
        while k < MAX_SEGMENT_STEPS and not stop_after:
            # ---- top of the loop: arrivals up to the CPU clock are visible
            if next_arrival_s <= cpu:
                loop.cpu_s = cpu
                loop._take_arrivals()
                next_arrival_s = loop.next_arrival_s()
            # ---- schedule(): the decodes (Scheduler._plan, allocation, _launch), inlined
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
                    if left <= 0:
                        continue  # batches in flight will finish it: never scheduled again
                    ph = r.num_placeholders
                    c = r.num_computed_tokens
                    if (
                        steady_ok and g == nd and ph == ph_s and out <= m.tail
                        and r.num_inflight_batches == nd and r.draft_hint is None
                    ):  # fmt: skip
                        m.steady = True  # in rhythm, and k drafts at this launch: steady
                        m.out = out
                        st.add(m)
                        if c + Kp > len(r.block_ids) * bs:
                            needs.append((m.key, r, c + Kp, m))
                        else:
                            set_ev(m)
                        continue
                    keep.append(m)
                    num_tokens = m.prompt + out + ph
                    hint = r.draft_hint
                    d = K if hint is None else hint
                    if d >= left:
                        d = left - 1
                    if d > max_len - num_tokens:
                        d = max_len - num_tokens
                    if d < 0:
                        d = 0
                    n = d + 1
                    total = c + n
                    if total > len(r.block_ids) * bs:
                        needs.append((m.key, r, total, None))
                    ents.append(Entry(r, c, n, d, True, False))
                    dec += n
                    drafts += d
                    kv += total
                    if total > longest:
                        longest = total
                    pairs += n * c + n * (n + 1) // 2
                    if m.hist:
                        hist += out + ph
                    ctx += m.prompt + out
                    r.num_computed_tokens = total
                    r.num_inflight_batches += 1
                    r.num_placeholders = ph + n
                    r.num_inflight_gen = g + 1
                self.individual = keep
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
                sched._admit(admitted, budget)
                if len(running) > loop.peak_running:
                    loop.peak_running = len(running)
            if admitted:
                pf = Scheduler._shape(admitted)  # before their launch, as schedule() takes it
                for e in admitted:
                    sched._launch(e)
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
                (
                    c_sched, c_prep, c_launch, c_sample, c_draft, c_po, c_gpu, c_dgpu,
                    a_sched, a_prep, a_launch, a_sample, a_draft, a_po, c_graph,
                ) = vals = costs.all(mx)  # fmt: skip
                quick = quick_costs(vals) and spread is None
                cur = mx
                reload = True  # the next verify step takes its constants again
            else:
                row = (b, 0, 0, dec, drafts, kv, pairs, longest, hist, ctx, 0, 0)
                if reload or b != last_b or dec != last_dec or drafts != last_drafts:
                    # the constant fields of a verify step (sh is one from the start)
                    sh.num_reqs = b
                    sh.decode_tokens = sh.num_tokens = dec
                    sh.draft_tokens = drafts
                    key = (b, dec, drafts)
                    (
                        c_sched, c_prep, c_launch, c_sample, c_draft, c_po, c_gpu, c_dgpu,
                        a_sched, a_prep, a_launch, a_sample, a_draft, a_po, c_graph,
                    ) = costs.const(sh, key)  # fmt: skip
                    quick = costs.quick(key)
                    last_b, last_dec, last_drafts = b, dec, drafts
                    reload = False
                sh.kv_read_tokens = kv
                sh.attn_pairs = pairs
                sh.max_kv_tokens = longest
                sh.history_tokens = hist
                sh.context_tokens = ctx
                cur = sh
            rows += row
            passes.append((snap, ents))
            step = s0 + k
            # ---- launch_step: CPU phases, the GPU pass
            if quick:  # the common case: only prep and the GPU pass vary, no GC in between
                sched0.append(cpu)
                cpu += c_sched
                sched1.append(cpu)
                if wait_counts:  # spec decoding before PR 32951: prep waits for the last counts
                    t = g_counts[k - 1] if k else last_counts
                    if t > cpu:
                        sync_step.append(step)
                        sync0.append(cpu)
                        cpu = t + wake
                        sync1.append(cpu)
                    prep0.append(cpu)
                cpu += c_prep if c_prep is not None else f_prep(cur) / 1e3
                prep1.append(cpu)
                launch0 = cpu
                cpu += c_launch
                launch1.append(cpu)
                gs = c_gpu if c_gpu is not None else f_gpu(cur) / 1e3
                if c_graph:
                    if cpu > gpu_free:
                        start = cpu
                        if cpu - gpu_free > idle_min_s:
                            gs *= idle_scale
                    else:
                        start = gpu_free
                    counts = start + gs
                else:
                    start = launch0 if launch0 > gpu_free else gpu_free
                    counts = start + gs
                    if cpu > counts:
                        counts = cpu
                gpu_free = counts + c_dgpu if c_dgpu > 0 else counts
                g_start.append(start)
                g_counts.append(counts)
                g_end.append(gpu_free)
                cpu += c_sample
                sample1.append(cpu)
                if cpu_ngram:
                    if gpu_free > cpu:  # the CPU proposer needs the sampled tokens
                        sync_step.append(step)
                        sync0.append(cpu)
                        cpu = gpu_free + wake
                        sync1.append(cpu)
                    draft0.append(cpu)
                cpu += c_draft
                draft1.append(cpu)
                po_s.append(c_po)
                po_a.append(a_po)
            else:  # the same, for any cost profile (and the CPU spread's multipliers)
                if spread is not None:  # x 1.0 leaves a time unchanged, bit for bit
                    j = step - jlo
                    m_sched, m_prep, m_launch = w_sched[j], w_prep[j], w_launch[j]
                    m_sample, m_draft, m_po = w_sample[j], w_draft[j], w_po[j]
                sched0.append(cpu)
                cpu += (c_sched if c_sched is not None else f_sched(cur) / 1e3) * m_sched
                a = a_sched if a_sched is not None else fa_sched(cur)
                if a > 0:
                    pause = gc_allocate(a)
                    if pause:  # before add_step: the pause counts on the previous step
                        pause_at((cpu, pause, gc.last_generation, P.SCHEDULE, step - 1))
                        cpu += pause
                sched1.append(cpu)
                if wait_counts:  # spec decoding before PR 32951: prep waits for the last counts
                    t = g_counts[k - 1] if k else last_counts
                    if t > cpu:
                        sync_step.append(step)
                        sync0.append(cpu)
                        cpu = t + wake
                        sync1.append(cpu)
                if wait_counts:
                    prep0.append(cpu)
                cpu += (c_prep if c_prep is not None else f_prep(cur) / 1e3) * m_prep
                a = a_prep if a_prep is not None else fa_prep(cur)
                if a > 0:
                    pause = gc_allocate(a)
                    if pause:
                        pause_at((cpu, pause, gc.last_generation, P.PREPARE_INPUTS, step))
                        cpu += pause
                prep1.append(cpu)
                launch0 = cpu
                cpu += (c_launch if c_launch is not None else f_launch(cur) / 1e3) * m_launch
                a = a_launch if a_launch is not None else fa_launch(cur)
                if a > 0:
                    pause = gc_allocate(a)
                    if pause:
                        pause_at((cpu, pause, gc.last_generation, P.LAUNCH, step))
                        cpu += pause
                launch1.append(cpu)
                # sim.stream.gpu_pass, inlined
                gs = c_gpu if c_gpu is not None else f_gpu(cur) / 1e3
                if c_graph if c_graph is not None else f_graph(cur):
                    if cpu > gpu_free:
                        start = cpu
                        if cpu - gpu_free > idle_min_s:
                            gs *= idle_scale
                    else:
                        start = gpu_free
                    counts = start + gs
                else:
                    start = launch0 if launch0 > gpu_free else gpu_free
                    counts = start + gs
                    if cpu > counts:
                        counts = cpu
                dg = c_dgpu if c_dgpu is not None else f_dgpu(cur) / 1e3
                gpu_free = counts + dg if dg > 0 else counts
                g_start.append(start)
                g_counts.append(counts)
                g_end.append(gpu_free)
                cpu += (c_sample if c_sample is not None else f_sample(cur) / 1e3) * m_sample
                a = a_sample if a_sample is not None else fa_sample(cur)
                if a > 0:
                    pause = gc_allocate(a)
                    if pause:
                        pause_at((cpu, pause, gc.last_generation, P.SAMPLE, step))
                        cpu += pause
                sample1.append(cpu)
                if cpu_ngram and gpu_free > cpu:  # the CPU proposer needs the sampled tokens
                    sync_step.append(step)
                    sync0.append(cpu)
                    cpu = gpu_free + wake
                    sync1.append(cpu)
                if cpu_ngram:
                    draft0.append(cpu)
                cpu += (c_draft if c_draft is not None else f_draft(cur) / 1e3) * m_draft
                a = a_draft if a_draft is not None else fa_draft(cur)
                if a > 0:
                    pause = gc_allocate(a)
                    if pause:
                        pause_at((cpu, pause, gc.last_generation, P.DRAFT, step))
                        cpu += pause
                draft1.append(cpu)
                po_s.append((c_po if c_po is not None else f_po(cur) / 1e3) * m_po)
                po_a.append(a_po if a_po is not None else fa_po(cur))
            # ---- complete_step of the oldest pass in flight
            t = old_end[k] if k < nd else g_end[k - nd]
            if t > cpu:
                sync_step.append(old_step[k] if k < nd else step - nd)
                sync0.append(cpu)
                cpu = t + wake
                sync1.append(cpu)
            po0.append(cpu)
            cpu += po_s[k]
            a = po_a[k]
            if a > 0 and gc_on:
                if gc.count0 + a <= gc_t0:  # GCModel.allocate without a collection, inlined
                    gc.count0 += a
                else:
                    pause = gc_allocate(a)
                    if pause:
                        pause_at((cpu, pause, gc.last_generation, P.PROCESS_OUTPUTS, step))
                        cpu += pause
            po1.append(cpu)
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
                    loop._draft_hints(batch.entries)
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
                        o = m.out + 1 + a
                        if o < m.ev or o <= m.tail:
                            if o >= m.ev:  # the next launch writes past its blocks
                                grow_next.append(m)
                            m.out = o
                            o += m.prompt  # its prompt + out, for the batch's longest
                            if o > top:
                                top = o
                            m.acc += a
                            d_out += 1 + a
                            if m.hist:
                                d_out_h += 1 + a
                            tok_rows.append(m.row)
                            tok_n.append(1 + a)
                            tok_acc.append(a)
                        else:
                            steady_event(m, a, cpu)
                    else:  # left the fast path after this launch
                        x, y = self.complete_general(m.req, K, True, cpu)
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
                    loop._draft_hints(ents)
            acc_per_it.append(accepted)
            emitted_per_it.append(emitted)
            k += 1
        run.n = k
        sched.num_steps += k
        loop.cpu_s, loop.gpu_free_s = cpu, gpu_free
        return run

    # ---- bulk bookkeeping ---------------------------------------------------------------------
    def record(self) -> None:
        loop, run, old = self.loop, self.run, self.old
        rec = loop.rec
        n, nd = run.n, self.nd
        s0 = rec.add_steps(
            np.fromiter(run.rows, np.int64, len(run.rows)).reshape(n, len(SHAPE_FIELDS)),
            {
                P.SCHEDULE: (run.sched0, run.sched1),
                P.PREPARE_INPUTS: (run.prep0 if self.wait_counts else run.sched1, run.prep1),
                P.LAUNCH: (run.prep1, run.launch1),
                P.SAMPLE: (run.launch1, run.sample1),
                P.DRAFT: (run.draft0 if loop._cpu_ngram else run.sample1, run.draft1),
            },
        )
        po0, po1 = run.po0, run.po1
        for k, p in enumerate(old[:n]):
            rec.phase(p.step, P.PROCESS_OUTPUTS, po0[k], po1[k])
            rec.gpu(p.step, p.gpu_start_s, p.gpu_end_s)
            if run.accepted[k]:
                rec.accepted(p.step, run.accepted[k])
        done = n - nd  # launched steps completed in the segment
        if done > 0:
            rec.phases(s0, P.PROCESS_OUTPUTS, po0[nd:n], po1[nd:n])
            rec.gpus(s0, run.gpu_start[:done], run.gpu_end[:done])
            rec.accepted_many(s0, run.accepted[nd:n])
        if run.sync_step:
            rec.syncs(run.sync_step, run.sync0, run.sync1)
        for start_s, dur_s, gen, phase, step in run.pauses:
            rec.gc_pause(start_s, dur_s, gen, phase, step)
        times = np.repeat(np.frombuffer(po1, np.float64)[:n], run.emitted)
        rec.tokens_many(
            np.frombuffer(run.tok_rows, np.int64), times,
            np.frombuffer(run.tok_n, np.int64), np.frombuffer(run.tok_acc, np.int64),
        )  # fmt: skip
        if loop.progress is not None:
            loop.progress(s0 + done - 1 if done > 0 else old[n - 1].step)

    def write_back(self) -> None:
        """Steady members' counters into their Requests, and the passes still in flight back
        to the loop as the step-by-step path has them."""
        from sim.loop import Pass

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
            g0, gc_, g1 = run.gpu_start[k], run.gpu_counts[k], run.gpu_end[k]
            inflight.append(Pass(batch, s0 + k, run.launch1[k], g0, gc_, g1))
        loop.inflight = deque(sorted(inflight, key=lambda p: p.step))
        if loop.check:
            loop.sched.check_invariants()


def _first(x: tuple[Any, ...]) -> Any:
    return x[0]
