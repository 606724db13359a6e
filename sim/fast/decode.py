"""Fast-forward: runs of decode steps computed in bulk, exactly as the step loop would.

A segment starts at the top of a loop iteration when (no speculative decoding, own arrivals):
- every running request is decoding and the batches in flight (depth - 1 of them) hold only
  running requests, each generating one token; or all but one, a prompt in chunks whose next
  chunk waits for KV blocks while the others, each with a batch in flight, decode (`_Stall`:
  nothing of it changes until blocks are freed).
Iteration k of the segment launches step s0 + k and completes the oldest pass in flight. Its
batch is the decode of every "member": a running request r with j1_r <= k < end_r, at position
cr_r + k (end_r: the first launch once the passes in flight surely finish it), followed by the
prompts `Scheduler.admit` admits (the real method, called with the step's leftover budget,
so waiting requests, prefix caching and admission failures behave as they do). An admitted
request becomes a member from the next launch on; a member finishes when its last pass
completes (its blocks are released then, through the block manager). Per-request state is
affine in k, so it is kept lazily (`_Member`) and batch sums are updated only when a request
joins or leaves (the longest context is the largest cr + k + 1 of the members, taken from a heap
with lazy deletion when the members change): a step costs O(1) plus the block allocations it
makes (done at once, in the per-step order: a member crosses into its next block every
block_size launches, so the members of launch k's grow class, k % block_size, get one each)
and what its arrivals, admissions and finishes touch. An iteration before the next drop or
finish, with no arrival due, no admission to try (or only one `Scheduler.admission_blocked`
knows fails) and no member settling in, is calm (members admitted the iteration before join
its sums first): calm iterations run one after another in a loop of their own (decode costs,
clock step; their grows after them, in one call, as far as the free blocks go).
The segment ends before a step the normal path must run: nothing to decode, more decode tokens
than the budget, fewer free blocks than the step's decodes need (preemption), a stalled prompt
chunk that may get its blocks, or after a step that admitted a partial prompt chunk.
Costs that read only the fields a batch size fixes are taken once per batch size
(sim.stepcosts.StepCosts.const); the rest are called on one mutable shape at every step. Each
step's timing is the step loop's own phase block (sim.clock.StepClock.launch / complete), so
the run is the same bit for bit (tests/test_sim_fastforward.py). At the end the recorder gets
the steps in bulk, request states are written back, and the passes still in flight become real
`ScheduledBatch` objects, so the normal path continues from there.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from heapq import heapify, heappop, heappush
from operator import attrgetter
from typing import Any

import numpy as np

from bubblesim.core.policy import Entry, ScheduledBatch, Scheduler
from bubblesim.core.request import Request
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape
from sim.clock import (
    GPU_END,
    NO_EVENT,
    PO1,
    PO_OBJS,
    PO_S,
    TIMES,
    Pass,
    launched_pass,
)
from sim.fast.bulk import last_completed, record_steps
from sim.fast.host import Host
from sim.stepcosts import StepShape

MAX_SEGMENT_STEPS = 1 << 16  # bounds the buffers of one segment
_TIMES_ROW = struct.Struct(f"={len(TIMES)}d")  # StepClock.step's times, packed
_PIECE = struct.Struct("=7q")  # a decode piece (_Run.pieces), packed
_ROW = struct.Struct(f"={1 + len(SHAPE_FIELDS)}q")  # a launch and its shape row, packed
# a decode step's shape row is written out positionally below
assert SHAPE_FIELDS == (
    "num_reqs", "num_prefill_reqs", "prefill_tokens", "decode_tokens", "draft_tokens",
    "kv_read_tokens", "attn_pairs", "max_kv_tokens", "history_tokens", "context_tokens",
    "new_reqs", "finished_reqs",
), SHAPE_FIELDS  # fmt: skip


class _Member:
    """A request decoding in the segment. Launch k (j1 <= k < end) decodes it at position
    cr + k with out + placeholders = hr + k; its confirmed outputs before launch k are a + k
    from launch s on. Its passes are launches l0 .. end - 1 (plus old passes for requests
    already running at the start)."""

    __slots__ = ("req", "key", "l0", "j1", "end", "cr", "hr", "a", "s", "o0", "old", "grows")

    def __init__(self, req: Request, key: int, l0: int, j1: int, end: int, cr: int) -> None:
        self.req = req
        self.key = key  # order in the running list (entry order in a batch)
        self.l0 = l0
        self.j1 = j1
        self.end = end
        self.cr = cr
        self.hr = 0
        self.a = 0
        self.s = 0
        self.o0 = 0  # confirmed outputs at the start, or when admitted (after a preemption)
        self.old: list[int] = [0]  # old passes holding it, cumulative: old[q] = among first q
        self.grows: list[Request] | None = None  # its grow class while it has launches to grow


class _Stall:
    """A running request in its prompt chunks that waits for KV blocks: at each schedule
    Scheduler.schedule plans its next chunk within the budget the decodes before it leave,
    `BlockManager.allocate` finds too few free blocks (no change) and no victim is found to
    preempt (every other running request has a batch in flight: FastForward._may_stall), so
    it is skipped and nothing of it changes. A segment runs beside it while that surely holds
    (`fails`) and ends before the first launch where it may not (a member's finish freed
    blocks, fewer decodes leave a larger chunk): the step loop schedules that launch."""

    __slots__ = ("req", "start", "known", "held", "block_size", "max_tokens")

    def __init__(self, req: Request, block_size: int, max_tokens: int) -> None:
        self.req = req
        self.start = req.num_computed_tokens
        self.known = req.num_tokens - self.start  # its prompt tokens left to compute
        self.held = len(req.block_ids)
        self.block_size = block_size
        self.max_tokens = max_tokens

    def fails(self, b: int, free: int) -> bool:
        """Whether its chunk surely finds too few blocks at a launch of b decodes (b <= the
        budget) with `free` blocks before their grows: the decodes before it take at most b
        of the budget, so the chunk has at least min(known, max_tokens - b) tokens, and at
        its turn at most `free` blocks are free."""
        n = self.max_tokens - b
        if self.known < n:
            n = self.known
        return -(-(self.start + n) // self.block_size) - self.held > free


@dataclass
class _Run:
    """What a segment computed: per launch k, and per iteration (the pass completed in it)."""

    n: int = 0
    # Packed as they are added (struct: no conversion after; a long list of tuples converted
    # at the end reads every tuple and int again, long out of the cache):
    # decode shapes: from launch k0 on, (k0, b, sum cr, max cr, sum hr, history members,
    # sum prompt+a) (_PIECE)
    pieces: bytearray = field(default_factory=bytearray)
    # other shapes: (launch, its row in SHAPE_FIELDS order) (_ROW), launches ascending, once each
    rows: bytearray = field(default_factory=bytearray)
    # StepClock.step of iteration k (_TIMES_ROW), and its pass's GPU end (read when that pass
    # completes)
    times: bytearray = field(default_factory=bytearray)
    gpu_end: list[float] = field(default_factory=list)
    # process_outputs seconds and objects of the pass completed in iteration i
    po_s: list[float] = field(default_factory=list)
    po_objs: list[int] = field(default_factory=list)
    members: list[_Member] = field(default_factory=list)
    admitted: dict[int, list[Entry]] = field(default_factory=dict)  # launch -> prompt entries


class FastForward:
    def __init__(self, loop: Host) -> None:
        self.loop = loop
        cfg = loop.sched.cfg
        self.max_seqs = cfg.max_num_seqs
        self.max_tokens = cfg.max_num_batched_tokens
        self.block_size = cfg.block_size
        self.chunked_prefill = cfg.chunked_prefill
        self.blocks = loop.sched.blocks  # the scheduler's block manager (kept for its life)
        self.num_segments = 0
        self.num_steps = 0

    def run_segment(self) -> bool:
        """Run a segment from the loop's current state; False (nothing done) if none applies."""
        loop = self.loop
        running = loop.sched.running
        nd = loop.depth - 1
        if not running or len(loop.inflight) != nd or len(running) > self.max_tokens:
            return False
        stalled = None
        for r in reversed(running):  # the latest admitted first: a recompute in prompt chunks
            if not r.in_decode:  # a prompt chunk to continue: one stalled for blocks, or none
                if stalled is not None or not self._may_stall(r, nd):
                    return False
                stalled = _Stall(r, self.block_size, self.max_tokens)
        old = list(loop.inflight)
        for p in old:
            for e in p.batch.entries:
                if not e.generates or e.num_drafts:
                    return False
        members = self._initial_members(old, running, stalled)
        if members is None:
            return False
        run = self._simulate(old, members, stalled)
        if run.n == 0:
            return False  # nothing changed: the first step already needs the normal path
        shapes = self._record(old, run)
        self._write_back(old, run, shapes)
        self.num_segments += 1
        self.num_steps += run.n
        return True

    def _may_stall(self, r: Request, nd: int) -> bool:
        """Whether running request `r`, in its prompt chunks, may be the segment's stalled
        one (_Stall): with batches in flight (nd >= 1: every other running request then has
        one at each schedule, so none is a victim the scheduler could preempt for it; checked
        at the start by _initial_members), chunked prefill, and none of its own in flight."""
        return nd >= 1 and self.chunked_prefill and r.num_inflight_batches == 0

    def _initial_members(
        self, old: list[Pass], running: list[Request], stalled: _Stall | None
    ) -> list[_Member] | None:
        """The running requests but `stalled` as members, or None when one is not plainly
        decoding (or, with a stalled request, has no batch in flight: a victim for it)."""
        nd = len(old)
        held: dict[int, list[int]] = {}  # request index -> old passes holding it (0/1 each)
        for q, p in enumerate(old):
            for e in p.batch.entries:
                held.setdefault(e.req.index, [0] * nd)[q] = 1
        bs = self.block_size
        members = []
        for key, r in enumerate(running):
            out, ph, c = r.num_output_tokens, r.num_placeholders, r.num_computed_tokens
            if stalled is not None and r is stalled.req:
                continue
            if not r.in_decode:
                return None  # a prompt chunk to continue
            flags = held.get(r.index, [0] * nd)
            cum = [0]
            for f in flags:
                cum.append(cum[-1] + f)
            n_old = cum[-1]
            if not (ph == r.num_inflight_gen == r.num_inflight_batches == n_old):
                return None
            if stalled is not None and not n_old:
                return None  # nothing in flight: the stalled request would preempt it
            if not c <= len(r.block_ids) * bs < c + bs:
                return None  # not the blocks its computed tokens take: not ours to model
            # launch k needs outputs_guaranteed = out + inflight_gen + k < output_len
            m = _Member(r, key, 0, 0, r.output_len - out - n_old, c)
            m.hr = out + ph
            m.a = out + n_old - nd
            m.s = nd
            m.o0 = out
            m.old = cum
            members.append(m)
        return members

    # ---- the steps ----------------------------------------------------------------------------
    def _simulate(self, old: list[Pass], members: list[_Member], stalled: _Stall | None) -> _Run:
        """SimLoop.launch_step + complete_step, iteration after iteration: the policy on the
        members' lazy state, each step's timing by the loop's own StepClock.step."""
        loop = self.loop
        sched, rec, costs, clock = loop.sched, loop.rec, loop.costs, loop.clock
        running, waiting = sched.running, sched.waiting
        tick_at_s = loop.tick_at_s
        bs, max_tokens, max_seqs = self.block_size, self.max_tokens, self.max_seqs
        nd = len(old)  # completed in iterations 0 .. nd - 1, before any launched pass
        s0 = rec.num_steps
        run = _Run(members=members)
        add_piece, pack_piece = run.pieces.extend, _PIECE.pack
        add_row, pack_row = run.rows.extend, _ROW.pack
        gpu_end = run.gpu_end
        clock_step = clock.step

        # Calendars (launch or iteration -> members) and the sums over the members of a launch.
        # A member admitted in iteration k joins the decode at launch k + 1: it is added to the
        # sums right away (nothing of iteration k reads them after its admissions) and
        # `changed` takes the new decode set into launch k + 1, with no calendar entry.
        drop: dict[int, list[_Member]] = {}  # launch k = end: leaves the decode
        # grow classes: a member decoding at cr + k crosses into its next KV block at the
        # launches k with (cr + k) % bs == 0, so classes[k % bs] lists (in entry order: keys
        # only grow) the requests launch k gives one more block, from when they join the
        # decode (their first crossing is within bs launches of then) until they leave it
        classes: list[list[Request]] = [[] for _ in range(bs)]
        done: dict[int, list[_Member]] = {}  # iteration: its last pass completes, it finishes
        chunk_done: dict[int, list[Request]] = {}  # iteration: a partial prompt chunk completes
        young: list[_Member] = []  # confirmed outputs not yet a + k
        # the launches / iterations with an entry in drop, done or chunk_done (a heap,
        # may repeat): an iteration before the smallest one, with no arrival, no admission to
        # try (or one Scheduler.admission_blocked: the free blocks only shrink meanwhile) and
        # no member settling in, is calm: only its grows and its decode vary
        marks: list[int] = []
        # (-cr, key, member) of every member that joined the decode; one that left (end <= k)
        # is dropped when it reaches the top: the top is then the longest context's member
        tops: list[tuple[int, int, _Member]] = []
        b = sum_cr = sum_hr = nh = sum_prompt = sum_a = top_cr = 0
        for m in members:
            r = m.req
            if m.end > 0:
                b += 1
                sum_cr += m.cr
                heappush(tops, (-m.cr, m.key, m))
                sum_prompt += r.prompt_len
                sum_a += m.a
                if r.needs_history:
                    nh += 1
                    sum_hr += m.hr
                drop.setdefault(m.end, []).append(m)
                first = len(r.block_ids) * bs - m.cr  # launch k writes position cr + k
                if first < m.end:  # 0 <= first < bs (_initial_members)
                    m.grows = classes[first % bs]
                    m.grows.append(r)
                done.setdefault(nd + m.end - 1, []).append(m)
                marks += (m.end, nd + m.end - 1)
            else:  # finished by the passes in flight
                last = max(q for q in range(nd) if m.old[q + 1] > m.old[q])
                done.setdefault(last, []).append(m)
                marks.append(last)
            if nd:
                young.append(m)
        heapify(marks)
        next_key = len(members)
        sh, mx = StepShape(), StepShape()  # this decode step's shape; a step with prompts'
        sh.set_decode(b)
        c: list[Any] = []  # the step's costs (sim.clock.COSTS)
        set_varying: Any = None  # sets those that vary: StepCosts.set_varying
        # the passes completed in iterations 0 .. nd - 1: the old ones
        po_s, po_objs = run.po_s, run.po_objs
        po_s.extend(p.po_s for p in old)
        po_objs.extend(p.po_objs for p in old)
        old_end = [p.gpu_end_s for p in old]
        old_step = [p.step for p in old]
        next_arrival_s = loop.next_arrival_s()
        cpu = clock.cpu_s
        stop_after = False
        reload = True
        # bound once: the loop below runs for every step of the segment
        drop_pop = drop.pop
        allocate_next = self.blocks.allocate_next
        chunk_done_pop, done_pop = chunk_done.pop, done.pop
        po_s_add, po_objs_add = po_s.append, po_objs.append
        times_add, gpu_end_add, pack = run.times.extend, gpu_end.append, _TIMES_ROW.pack
        marks_add = partial(heappush, marks)
        k = calm_until = 0
        changed = False  # launch k decodes other members than launch k - 1
        admitted: list[Entry] | None = None  # a list only when admit runs
        while k < MAX_SEGMENT_STEPS and not stop_after:
            full = k >= calm_until or next_arrival_s <= cpu  # else calm (below)
            if full:
                # ---- top of the loop: arrivals up to the CPU clock are visible
                if next_arrival_s <= cpu:
                    next_arrival_s = loop.take_arrivals()
                # ---- schedule(): the decodes of this launch
                left = drop_pop(k, None)
                if left is not None:
                    changed = True
                    for m in left:
                        r = m.req
                        if m.grows is not None:
                            m.grows.remove(r)
                        b -= 1
                        sum_cr -= m.cr
                        sum_prompt -= r.prompt_len
                        sum_a -= m.a
                        if r.needs_history:
                            nh -= 1
                            sum_hr -= m.hr
            if changed or not k:  # this launch's decode sums (nothing here reads the blocks)
                if b == 0 or b > max_tokens:
                    break  # an empty or budget-cut schedule: the normal path runs it
                while tops[0][2].end <= k:  # b > 0: a member of this launch is in the heap
                    heappop(tops)
                top_cr = -tops[0][0]
                add_piece(pack_piece(k, b, sum_cr, top_cr, sum_hr, nh, sum_prompt + sum_a))
                sh.set_decode(b)
                reload = True
                changed = False
            if stalled is not None and not stalled.fails(b, self.blocks.num_free):
                break  # the stalled chunk may get its blocks: the normal path schedules it
            if not full and k >= nd > 0:
                # calm iterations one after another: the path below, without its checks.
                # Their grows are made after them, in launch order, in one call (nothing a calm
                # iteration does reads the block manager): `end` stops before the first launch
                # whose grows would find too few free blocks (`short`: the normal path
                # preempts there)
                if reload:
                    c = list(costs.const(sh, b))
                    set_varying = costs.set_varying(b)
                    reload = False
                k0 = k
                end, short = self._calm_end(classes, k, min(calm_until, MAX_SEGMENT_STEPS), b)
                # a step whose CPU clock reaches the next arrival or the progress tick ends it
                stop_s = next_arrival_s if next_arrival_s < tick_at_s else tick_at_s
                # launch k's varying shape fields (as below), each advanced by its rate per
                # launch; `at`: the launch whose pass iteration k completes
                kv = sum_cr + b * (k + 1)
                longest = top_cr + k + 1
                hist = sum_hr + nh * k
                ctx = sum_prompt + sum_a + b * k
                at = k - nd
                while k < end:
                    sh.kv_read_tokens = sh.attn_pairs = kv
                    sh.max_kv_tokens = longest
                    sh.history_tokens = hist
                    sh.context_tokens = ctx
                    set_varying(sh, c)
                    step = s0 + k
                    po_s_add(c[PO_S])
                    po_objs_add(c[PO_OBJS])
                    t = clock_step(step, c, NO_EVENT, step - nd, gpu_end[at], po_s[k], po_objs[k])
                    times_add(pack(*t))
                    gpu_end_add(t[GPU_END])
                    k += 1
                    kv += b
                    longest += 1
                    hist += nh
                    ctx += b
                    at += 1
                    if t[PO1] >= stop_s:
                        break
                cpu = clock.cpu_s
                if k > k0:
                    grown = [r for j in range(k0, k) for r in classes[j % bs]]
                    if grown:
                        ok = allocate_next(grown)
                        assert ok, "a calm stretch's grows fit the free blocks (_calm_end)"
                if cpu >= tick_at_s:
                    stop_after = True  # the progress hook looks now (sim.loop.SimLoop.tick_at_s)
                elif short and k == end and next_arrival_s > cpu:
                    break  # the normal path preempts
                continue
            grows = classes[k % bs]
            if grows and not allocate_next(grows):
                break  # the normal path preempts
            kv = sum_cr + b * (k + 1)
            longest = top_cr + k + 1
            ctx = sum_prompt + sum_a + b * k
            hist = sum_hr + nh * k
            settling = False  # members settling in: this decode's row is written out
            if full:
                if young:
                    corr = self._young_correction(young, k)
                    if corr:
                        ctx += corr
                        settling = True
                budget = max_tokens - b
                admitted = None
                if waiting and budget > 0 and len(running) < max_seqs:
                    admitted = []
                    sched.admit(admitted, budget)
                    if len(running) > loop.peak_running:
                        loop.peak_running = len(running)
            if admitted:
                (
                    p_reqs, p_prefills, p_prefill_tok, p_decode_tok, p_drafts, p_kv, p_pairs,
                    p_longest, p_hist, p_ctx, p_new, p_finished,
                ) = Scheduler.shape_row(admitted)  # fmt: skip
                row = (
                    b + p_reqs, p_prefills, p_prefill_tok, b + p_decode_tok, p_drafts,
                    kv + p_kv, kv + p_pairs, max(longest, p_longest), hist + p_hist,
                    ctx + p_ctx, p_new, p_finished,
                )  # fmt: skip
                add_row(pack_row(k, *row))
                for e in admitted:
                    sched.launch(e)
                run.admitted[k] = admitted
                for e in admitted:
                    r = e.req
                    if not e.generates:  # a partial prompt chunk: the normal path continues it
                        chunk_done.setdefault(nd + k, []).append(r)
                        marks_add(nd + k)
                        stop_after = True
                        continue
                    # after its prompt pass (a recompute after preemption includes the
                    # outputs it had): computed c, out o0 confirmed, one placeholder
                    o0 = r.num_output_tokens
                    computed = e.start_pos + e.num_tokens
                    m = _Member(r, next_key, k, k + 1, k + r.output_len - o0, computed - k - 1)
                    next_key += 1
                    m.hr = o0 - k
                    m.a = o0 - nd - k
                    m.s = nd + k
                    m.o0 = o0
                    run.members.append(m)
                    if m.end > m.j1:  # joins the decode at launch j1 = k + 1
                        changed = True
                        b += 1
                        sum_cr += m.cr
                        heappush(tops, (-m.cr, m.key, m))
                        sum_prompt += r.prompt_len
                        sum_a += m.a
                        if r.needs_history:
                            nh += 1
                            sum_hr += m.hr
                        drop.setdefault(m.end, []).append(m)
                        marks_add(m.end)
                        first = m.j1 + len(r.block_ids) * bs - computed
                        if first < m.end:
                            assert first < m.j1 + bs, r  # blocks for its computed tokens
                            m.grows = classes[first % bs]
                            m.grows.append(r)
                        if m.s > m.j1:
                            young.append(m)
                    done.setdefault(nd + m.end - 1, []).append(m)
                    marks_add(nd + m.end - 1)
                mx.set_row(row)
                c = costs.all(mx)
                reload = True  # the next decode step takes the decode costs again
            else:
                if settling:
                    add_row(pack_row(k, b, 0, 0, b, 0, kv, kv, longest, hist, ctx, 0, 0))
                if reload:
                    c = list(costs.const(sh, b))
                    set_varying = costs.set_varying(b)
                    reload = False
                sh.kv_read_tokens = sh.attn_pairs = kv
                sh.max_kv_tokens = longest
                sh.history_tokens = hist
                sh.context_tokens = ctx
                set_varying(sh, c)
            step = s0 + k
            # ---- launch_step, then complete_step of the oldest pass in flight
            po_s_add(c[PO_S])
            po_objs_add(c[PO_OBJS])
            if k >= nd:  # the pass launched nd iterations ago (nd = 0: the one launched now)
                t = clock_step(
                    step, c, NO_EVENT, step - nd, gpu_end[k - nd] if nd else None,
                    po_s[k], po_objs[k],
                )  # fmt: skip
            else:  # an old pass
                t = clock_step(step, c, NO_EVENT, old_step[k], old_end[k], po_s[k], po_objs[k])
            times_add(pack(*t))
            gpu_end_add(t[GPU_END])
            cpu = t[PO1]
            if cpu >= tick_at_s:
                stop_after = True  # the progress hook looks now (sim.loop.SimLoop.tick_at_s)
            if full:
                chunks = chunk_done_pop(k, None) if chunk_done else None
                if chunks is not None:
                    for r in chunks:
                        r.num_inflight_batches -= 1
                finished = done_pop(k, None)
                if finished is not None:
                    self._finish(finished, k + 1, nd, cpu)
                # the next calm iteration: none while an admission may be tried or a member
                # settles in, else up to the next calendar entry
                while marks and marks[0] <= k:
                    heappop(marks)
                if young or (
                    waiting
                    and max_tokens > b
                    and len(running) < max_seqs
                    and not sched.admission_blocked(max_tokens - b)
                ):
                    calm_until = k + 1
                else:
                    calm_until = marks[0] if marks else MAX_SEGMENT_STEPS
                admitted = None
            k += 1
        run.n = k
        return run

    def _calm_end(self, classes: list[list[Request]], k: int, end: int, b: int) -> tuple[int, bool]:
        """How far calm launches k .. end - 1 go with the free blocks their grows take (launch
        j: one for each of classes[j % bs], in launch order; the classes hold b requests at
        most): (a launch they surely reach, or the first whose grows find too few blocks;
        whether it is that one)."""
        free = self.blocks.num_free
        bs = self.block_size
        if free >= b * -(-(end - k) // bs):  # b blocks per bs launches at most
            return end, False
        per_round = sum(map(len, classes))  # any bs launches in a row take this many
        if free >= per_round:  # whole rounds surely fit; the next stretch looks again
            return min(end, k + bs * (free // per_round)) if per_round else end, False
        for j in range(k, min(end, k + bs)):  # less than a round: a launch in it is short
            free -= len(classes[j % bs])
            if free < 0:
                return j, True
        return end, False

    @staticmethod
    def _young_correction(young: list[_Member], k: int) -> int:
        """Sum over members still settling in of (confirmed outputs before launch k) - (a + k);
        drops those that have settled."""
        corr = 0
        keep = []
        for m in young:
            if k >= m.s or k >= m.end:
                continue
            keep.append(m)
            if k >= m.j1:
                explicit = m.o0 + m.old[k] if m.j1 == 0 else m.o0  # initial: k < nd
                corr += explicit - m.a - k
        young[:] = keep
        return corr

    def _finish(self, finished: list[_Member], n: int, nd: int, t: float) -> None:
        """Their last pass completed (iteration n - 1): `Scheduler.complete` finishes them."""
        sched, rec = self.loop.sched, self.loop.rec
        if len(finished) > 1:
            finished.sort(key=_key)  # entry order: blocks return to the free queue in it
        for m in finished:
            r = m.req
            _set_state(m, n, nd)
            assert r.num_output_tokens == r.output_len and r.num_inflight_batches == 0, r
            sched.finish(r)
            if r.block_ids:
                sched.blocks.release(r)
            rec.finish(r.index, t)

    # ---- bulk bookkeeping ---------------------------------------------------------------------
    def _record(self, old: list[Pass], run: _Run) -> np.ndarray:
        """The segment's steps into the recorder; returns their shapes."""
        loop = self.loop
        rec = loop.rec
        n, nd = run.n, len(old)
        shapes = _shape_rows(run)
        t = np.frombuffer(run.times, np.float64).reshape(n, len(TIMES))
        s0, po1 = record_steps(rec, loop.clock, old, shapes, t)
        for k, p in enumerate(old[:n]):
            rec.tokens_each([e.req.index for e in p.batch.entries], po1[k : k + 1])
        rows, starts, stops = [], [], []
        for m in run.members:
            # its passes are launches l0 .. end - 1, completed in iterations nd + l
            stop = nd + m.end if nd + m.end < n else n
            if nd + m.l0 < stop:
                rows.append(m.req.index)
                starts.append(nd + m.l0)
                stops.append(stop)
        rec.tokens_ranges(rows, starts, stops, po1)
        if loop.progress is not None:
            loop.progress(last_completed(s0, old, n))
        return shapes

    def _write_back(self, old: list[Pass], run: _Run, shapes: np.ndarray) -> None:
        """Leave requests, the scheduler and the loop as the step-by-step path would have."""
        loop = self.loop
        sched = loop.sched
        n, nd = run.n, len(old)
        for p in old[:n]:
            p.batch.completed = True
        live = [m for m in run.members if not m.req.is_finished]
        for m in live:
            _set_state(m, n, nd)
        first = sched.num_steps
        sched.num_steps += n
        inflight: deque[Pass] = deque(old[n:])
        s0 = loop.rec.num_steps - n
        for k in range(max(0, n - nd), n):  # launches still in flight, in launch order
            entries = [Entry(m.req, m.cr + k, 1, 0, True, False) for m in live if m.j1 <= k < m.end]
            entries.extend(run.admitted.get(k, ()))
            shape = BatchShape(*shapes[k].tolist())
            batch = ScheduledBatch(first + k, entries, shape)
            po = run.po_s[nd + k], run.po_objs[nd + k]
            t = _TIMES_ROW.unpack_from(run.times, k * _TIMES_ROW.size)
            inflight.append(launched_pass(batch, s0 + k, t, po))
        loop.inflight = inflight
        if loop.check:
            sched.check_invariants()


# a member's order in the running list (entry order); C, as sort keys go per element
_key = attrgetter("key")


def _shape_rows(run: _Run) -> np.ndarray:
    """(n, len(SHAPE_FIELDS)) int64: the decode pieces evaluated at every launch, then the
    launches whose shape was written out."""
    n = run.n
    p = np.frombuffer(run.pieces, np.int64).reshape(-1, 7)
    p = p[p[:, 0] < n]  # launches from n on did not run
    lengths = np.diff(np.append(p[:, 0], n))
    b, sum_cr, top_cr, sum_hr, nh, sum_pa = np.repeat(p[:, 1:], lengths, axis=0).T
    k = np.arange(n, dtype=np.int64)
    out = np.zeros((n, len(SHAPE_FIELDS)), dtype=np.int64, order="F")  # by column, as recorded
    out[:, 0] = out[:, 3] = b  # num_reqs, decode_tokens
    out[:, 5] = out[:, 6] = sum_cr + b * (k + 1)  # kv_read_tokens, attn_pairs
    out[:, 7] = top_cr + k + 1  # max_kv_tokens
    out[:, 8] = sum_hr + nh * k  # history_tokens
    out[:, 9] = sum_pa + b * k  # context_tokens
    if run.rows:  # launches from n on did not run
        rows = np.frombuffer(run.rows, np.int64).reshape(-1, 1 + len(SHAPE_FIELDS))
        ran = rows[rows[:, 0] < n]
        out[ran[:, 0]] = ran[:, 1:]
    return out


def _set_state(m: _Member, n: int, nd: int) -> None:
    """The request's counters after n iterations of the segment (passes at positions < n
    completed, each emitting one token; the rest in flight)."""
    r = m.req
    end = min(m.end, n)  # launches it was in: l0 .. end - 1
    if m.j1 == 0:  # running at the start: old passes, then launches 0 .. end - 1
        launched = max(0, end)
        old_done = m.old[min(n, nd)]
        completed = old_done + max(0, min(m.end, n - nd))
        total = m.old[nd] + launched
        r.num_computed_tokens = m.cr + launched
        r.num_output_tokens = m.o0 + completed
    else:  # admitted at launch l0: its prompt pass, then decodes l0 + 1 .. end - 1
        total = end - m.l0
        completed = max(0, min(m.end, n - nd) - m.l0)
        r.num_computed_tokens = m.cr + m.j1 + total - 1
        r.num_output_tokens = m.o0 + completed
    left = total - completed
    r.num_placeholders = r.num_inflight_gen = r.num_inflight_batches = left
