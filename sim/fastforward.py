"""Fast-forward: runs of decode steps computed in bulk, exactly as the step loop would.

A segment starts at the top of a loop iteration when (no speculative decoding, own arrivals):
- every running request is decoding and the batches in flight (depth - 1 of them) hold only
  running requests, each generating one token.
Iteration k of the segment launches step s0 + k and completes the oldest pass in flight. Its
batch is the decode of every "member": a running request r with j1_r <= k < end_r, at position
cr_r + k (end_r: the first launch once the passes in flight surely finish it), followed by the
prompts `Scheduler._admit` admits (the real method, called with the step's leftover budget,
so waiting requests, prefix caching and admission failures behave as they do). An admitted
request becomes a member from the next launch on; a member finishes when its last pass
completes (its blocks are released then, through the block manager). Per-request state is
affine in k, so it is kept lazily (`_Member`) and batch sums are updated only when a request
joins or leaves (the longest context is the largest cr + k + 1 of the members, taken from a heap
with lazy deletion when the members change): a step costs O(1) plus the block allocations it
makes (done at once, in the per-step order) and what its arrivals, admissions and finishes
touch.
The segment ends before a step the normal path must run: nothing to decode, more decode tokens
than the budget, fewer free blocks than the step's decodes need (preemption), or after a step
that admitted a partial prompt chunk.
Costs that read none of the fields that change with k (VARYING) are taken once per batch size
(`_Costs`); the rest are called on one mutable shape. The CPU clock with its GC pauses and sync
waits and the GPU stream's max(ready, previous end) run as a scalar loop with the same float
operations in the same order as `SimLoop.launch_step` and `SimLoop.complete_step`, so the run
is the same bit for bit (tests/test_sim_fastforward.py). At the end the recorder gets the steps
in bulk, request states are written back, and the passes still in flight become real
`ScheduledBatch` objects, so the normal path continues from there.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import TYPE_CHECKING, Any

import numpy as np

from core import phases as P
from core.policy import Entry, ScheduledBatch, Scheduler
from core.request import Request
from core.shape import SHAPE_FIELDS, BatchShape

if TYPE_CHECKING:
    from sim.loop import Pass, SimLoop

MAX_SEGMENT_STEPS = 1 << 16  # bounds the lists of one segment
VARYING = ("kv_read_tokens", "attn_pairs", "max_kv_tokens", "history_tokens", "context_tokens")
# a decode step's shape row is written out positionally below
assert SHAPE_FIELDS == (
    "num_reqs", "num_prefill_reqs", "prefill_tokens", "decode_tokens", "draft_tokens",
    "kv_read_tokens", "attn_pairs", "max_kv_tokens", "history_tokens", "context_tokens",
    "new_reqs", "finished_reqs",
), SHAPE_FIELDS  # fmt: skip
CostFn = Callable[[Any], Any]


class _Shape:
    """A mutable BatchShape stand-in: the shape of a segment's current step."""

    __slots__ = (*SHAPE_FIELDS, "num_tokens", "is_pure_decode")

    def __init__(self) -> None:
        self.set_decode(0)
        self.kv_read_tokens = 0  # varying: VARYING lists these five
        self.attn_pairs = 0
        self.max_kv_tokens = 0
        self.history_tokens = 0
        self.context_tokens = 0

    def set_decode(self, b: int) -> None:
        """The constant fields of a decode of b requests."""
        self.num_reqs = b
        self.num_prefill_reqs = 0
        self.prefill_tokens = 0
        self.decode_tokens = b
        self.draft_tokens = 0
        self.new_reqs = 0
        self.finished_reqs = 0
        self.num_tokens = b
        self.is_pure_decode = b > 0

    def set_verify(self, b: int, tokens: int, drafts: int) -> None:
        """The constant fields of a speculative verify step: b decodes, `drafts` of whose
        `tokens` query tokens are drafts."""
        self.set_decode(b)
        self.decode_tokens = self.num_tokens = tokens
        self.draft_tokens = drafts

    def set_row(self, row: tuple[int, ...]) -> None:
        (
            self.num_reqs, self.num_prefill_reqs, self.prefill_tokens, self.decode_tokens,
            self.draft_tokens, self.kv_read_tokens, self.attn_pairs, self.max_kv_tokens,
            self.history_tokens, self.context_tokens, self.new_reqs, self.finished_reqs,
        ) = row  # fmt: skip  # SHAPE_FIELDS order (asserted above)
        self.num_tokens = self.prefill_tokens + self.decode_tokens
        self.is_pure_decode = self.num_prefill_reqs == 0 and self.num_reqs > 0


class _Probe:
    """Reads through to a shape and notes whether a varying field was read."""

    def __init__(self, shape: _Shape) -> None:
        self._shape = shape
        self.varying = False

    def __getattr__(self, name: str) -> Any:
        if name in VARYING:
            self.varying = True
        return getattr(self._shape, name)


class _Costs:
    """What `SimLoop` computes from a step's shape, as functions: the milliseconds of the CPU
    phases (launch with launch_ms), the GPU pass and the GPU drafter (the loops divide by 1e3 as
    SimLoop does), the phases' net tracked objects, and whether the forward is one CUDA graph.
    `fns` take any shape; `decode_fns` only pure decodes (the GPU pass without its dispatch)."""

    NUM_MS = 8  # the first eight give milliseconds

    def __init__(self, loop: SimLoop) -> None:
        cost, graphs = loop.cost, loop._graphs

        def launch_ms(s: Any) -> float:  # SimLoop._phase_time: launch includes launch_ms
            return cost.cpu_phase_ms(P.LAUNCH, s) + cost.launch_ms(s, graphs)

        def alloc(p: str) -> CostFn:
            return lambda s: cost.alloc_objects(p, s)

        def graphed(s: Any) -> bool:
            return cost.graphed(s, graphs)

        phases: list[CostFn] = [
            launch_ms if p == P.LAUNCH else cost.phase_ms_fn(p) for p in P.CPU_PHASES
        ]
        rest: list[CostFn] = [cost.draft_gpu_ms_fn(), *(alloc(p) for p in P.CPU_PHASES), graphed]
        self.fns = [*phases, cost.gpu_pass_ms, *rest]
        self.decode_fns = [*phases, cost.gpu_decode_ms_fn(), *rest]
        self._const: dict[Any, list[Any]] = {}
        self._quick: dict[Any, bool] = {}
        self._spread = loop.spread is not None  # per-step phase times: never the quick block

    def const(self, shape: _Shape, key: Any = None) -> list[Any]:
        """For a decode of shape.num_reqs requests, per function: its value (the same at every
        step) or None when it reads a varying field. Cached by `key`, which must determine the
        constant fields: the batch size (the default) for plain decodes."""
        if key is None:
            key = shape.num_reqs
        out = self._const.get(key)
        if out is None:
            out = []
            for i, fn in enumerate(self.decode_fns):
                probe = _Probe(shape)
                fn(probe)
                if probe.varying:
                    out.append(None)
                else:
                    out.append(fn(shape) / 1e3 if i < self.NUM_MS else fn(shape))
            self._const[key] = out
            self._quick[key] = quick_costs(out) and not self._spread
        return out

    def quick(self, key: Any) -> bool:
        """quick_costs of `const` for this key (after `const`)."""
        return self._quick[key]

    def all(self, shape: _Shape) -> list[Any]:
        n = self.NUM_MS
        return [fn(shape) / 1e3 if i < n else fn(shape) for i, fn in enumerate(self.fns)]


def quick_costs(v: list[Any]) -> bool:
    """Whether a step's costs (`_Costs` order) fit the loops' quick block: the CPU phases but
    prepare_inputs, the draft pass and the graph decision constant, and no GC allocation
    before process_outputs (so no pause there)."""
    (
        c_sched, _, c_launch, c_sample, c_draft, c_po, _, c_dgpu,
        a_sched, a_prep, a_launch, a_sample, a_draft, a_po, c_graph,
    ) = v  # fmt: skip
    consts = (c_sched, c_launch, c_sample, c_draft, c_po, c_dgpu, c_graph, a_po)
    allocs = (a_sched, a_prep, a_launch, a_sample, a_draft)  # None: it varies
    return all(x is not None for x in consts) and all(a == 0 for a in allocs)


class _Member:
    """A request decoding in the segment. Launch k (j1 <= k < end) decodes it at position
    cr + k with out + placeholders = hr + k; its confirmed outputs before launch k are a + k
    from launch s on. Its passes are launches l0 .. end - 1 (plus old passes for requests
    already running at the start)."""

    __slots__ = ("req", "key", "l0", "j1", "end", "cr", "hr", "a", "s", "o0", "old")

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


def _times() -> array[float]:
    return array("d")


def _ints() -> array[int]:
    return array("q")


@dataclass
class _Run:
    """What a segment computed: per launch k, and per iteration (the pass completed in it)."""

    n: int = 0
    # decode shapes: from launch k0 on,
    # (k0, b, sum cr, max cr, sum hr, history members, sum prompt+a)
    pieces: list[tuple[int, int, int, int, int, int, int]] = field(default_factory=list)
    rows: dict[int, tuple[int, ...]] = field(default_factory=dict)  # other shapes, by launch
    sched0: array[float] = field(default_factory=_times)
    sched1: array[float] = field(default_factory=_times)
    prep1: array[float] = field(default_factory=_times)
    launch1: array[float] = field(default_factory=_times)
    sample1: array[float] = field(default_factory=_times)
    draft1: array[float] = field(default_factory=_times)
    gpu_start: array[float] = field(default_factory=_times)
    gpu_counts: array[float] = field(default_factory=_times)
    gpu_end: array[float] = field(default_factory=_times)
    po0: array[float] = field(default_factory=_times)  # per iteration
    po1: array[float] = field(default_factory=_times)
    sync_step: array[int] = field(default_factory=_ints)
    sync0: array[float] = field(default_factory=_times)
    sync1: array[float] = field(default_factory=_times)
    pauses: list[tuple[float, float, int, str, int]] = field(default_factory=list)
    members: list[_Member] = field(default_factory=list)
    admitted: dict[int, list[Entry]] = field(default_factory=dict)  # launch -> prompt entries


class FastForward:
    def __init__(self, loop: SimLoop) -> None:
        self.loop = loop
        cfg = loop.sched.cfg
        self.max_seqs = cfg.max_num_seqs
        self.max_tokens = cfg.max_num_batched_tokens
        self.block_size = cfg.block_size
        self.costs = _Costs(loop)
        self.num_segments = 0
        self.num_steps = 0

    def run_segment(self) -> bool:
        """Run a segment from the loop's current state; False (nothing done) if none applies."""
        loop = self.loop
        running = loop.sched.running
        nd = loop.depth - 1
        if not running or len(loop.inflight) != nd or len(running) > self.max_tokens:
            return False
        old = list(loop.inflight)
        for p in old:
            for e in p.batch.entries:
                if not e.generates or e.num_drafts:
                    return False
        members = self._initial_members(old, running)
        if members is None:
            return False
        run = self._simulate(old, members)
        if run.n == 0:
            return False  # nothing changed: the first step already needs the normal path
        shapes = self._record(old, run)
        self._write_back(old, run, shapes)
        self.num_segments += 1
        self.num_steps += run.n
        return True

    def _initial_members(self, old: list[Pass], running: list[Request]) -> list[_Member] | None:
        """The running requests as members, or None when one is not plainly decoding."""
        nd = len(old)
        held: dict[int, list[int]] = {}  # request index -> old passes holding it (0/1 each)
        for q, p in enumerate(old):
            for e in p.batch.entries:
                held.setdefault(e.req.index, [0] * nd)[q] = 1
        bs = self.block_size
        members = []
        for key, r in enumerate(running):
            out, ph, c = r.num_output_tokens, r.num_placeholders, r.num_computed_tokens
            if r.prompt_len + out + ph - c != 1 or out + ph == 0:
                return None  # not decoding
            flags = held.get(r.index, [0] * nd)
            cum = [0]
            for f in flags:
                cum.append(cum[-1] + f)
            n_old = cum[-1]
            if not (ph == r.num_inflight_gen == r.num_inflight_batches == n_old):
                return None
            if len(r.block_ids) * bs < c:
                return None  # fewer blocks than computed tokens: not ours to model
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
    def _simulate(self, old: list[Pass], members: list[_Member]) -> _Run:
        """SimLoop.launch_step + complete_step, iteration after iteration, on plain numbers."""
        loop = self.loop
        sched, gc, rec, costs = loop.sched, loop.gc, loop.rec, self.costs
        blocks = sched.blocks
        running, waiting = sched.running, sched.waiting
        gc_allocate = gc.allocate
        gc_on, gc_t0 = gc.enabled, gc.t0
        tick_at_s = loop.tick_at_s
        bs, max_tokens, max_seqs = self.block_size, self.max_tokens, self.max_seqs
        nd = len(old)  # completed in iterations 0 .. nd - 1, before any launched pass
        s0 = rec.num_steps
        run = _Run(members=members)
        pieces, rows = run.pieces, run.rows
        sched0, sched1, prep1 = run.sched0, run.sched1, run.prep1
        launch1, sample1, draft1 = run.launch1, run.sample1, run.draft1
        g_start, g_counts, g_end = run.gpu_start, run.gpu_counts, run.gpu_end
        po0, po1, pauses = run.po0, run.po1, run.pauses
        sync_step, sync0, sync1 = run.sync_step, run.sync0, run.sync1
        pause_at = pauses.append

        # Calendars (launch or iteration -> members) and the sums over the members of a launch.
        drop: dict[int, list[_Member]] = {}  # launch k = end: leaves the decode
        join: dict[int, list[_Member]] = {}  # launch k = j1: joins it
        grow: dict[int, list[_Member]] = {}  # launch k: needs one more KV block
        done: dict[int, list[_Member]] = {}  # iteration: its last pass completes, it finishes
        chunk_done: dict[int, list[Request]] = {}  # iteration: a partial prompt chunk completes
        young: list[_Member] = []  # confirmed outputs not yet a + k
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
                if first < m.end:
                    grow.setdefault(first, []).append(m)
                done.setdefault(nd + m.end - 1, []).append(m)
            else:  # finished by the passes in flight
                last = max(q for q in range(nd) if m.old[q + 1] > m.old[q])
                done.setdefault(last, []).append(m)
            if nd:
                young.append(m)
        next_key = len(members)
        sh, mx = _Shape(), _Shape()
        sh.set_decode(b)
        const = costs.const(sh)
        fns = costs.decode_fns  # any value they give is taken from `const` for other shapes
        f_sched, f_prep, f_launch, f_sample, f_draft, f_po, f_gpu, f_dgpu = fns[:8]
        fa_sched, fa_prep, fa_launch, fa_sample, fa_draft, fa_po, f_graph = fns[8:]
        # process_outputs of the pass completed in iteration i: old passes, then launch i - nd
        po_s = [loop.cost.cpu_phase_ms(P.PROCESS_OUTPUTS, p.batch.shape) / 1e3 for p in old]
        po_a = [loop.cost.alloc_objects(P.PROCESS_OUTPUTS, p.batch.shape) for p in old]
        old_end = [p.gpu_end_s for p in old]
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
        next_arrival_s = loop.next_arrival_s()
        cpu, gpu_free = loop.cpu_s, loop.gpu_free_s
        idle_scale, idle_min_s = loop.cost.idle_start_scale, loop.cost.idle_start_min_s
        wake = loop.cost.sync_wake_s  # a host wait ends this long after its event
        stop_after = False
        reload = True
        k = 0
        while k < MAX_SEGMENT_STEPS and not stop_after:
            # ---- top of the loop: arrivals up to the CPU clock are visible
            if next_arrival_s <= cpu:
                loop.cpu_s = cpu
                loop._take_arrivals()
                next_arrival_s = loop.next_arrival_s()
            # ---- schedule(): the decodes of this launch
            changed = False
            left = drop.pop(k, None)
            if left is not None:
                changed = True
                for m in left:
                    r = m.req
                    b -= 1
                    sum_cr -= m.cr
                    sum_prompt -= r.prompt_len
                    sum_a -= m.a
                    if r.needs_history:
                        nh -= 1
                        sum_hr -= m.hr
            joined = join.pop(k, None)
            if joined is not None:
                changed = True
                for m in joined:
                    r = m.req
                    b += 1
                    sum_cr += m.cr
                    heappush(tops, (-m.cr, m.key, m))
                    sum_prompt += r.prompt_len
                    sum_a += m.a
                    if r.needs_history:
                        nh += 1
                        sum_hr += m.hr
            if b == 0 or b > max_tokens:
                break  # an empty or budget-cut schedule: the normal path runs it
            need = grow.pop(k, None)
            if need is not None:
                if len(need) > blocks.num_free:
                    grow[k] = need
                    break  # the normal path preempts
                if len(need) > 1:
                    need.sort(key=_key)
                for m in need:
                    ok = blocks.allocate(m.req, m.cr + k + 1)
                    assert ok
                    if k + bs < m.end:
                        grow.setdefault(k + bs, []).append(m)
            if changed or not k:
                while tops[0][2].end <= k:  # b > 0: a member of this launch is in the heap
                    heappop(tops)
                top_cr = -tops[0][0]
                pieces.append((k, b, sum_cr, top_cr, sum_hr, nh, sum_prompt + sum_a))
            kv = sum_cr + b * (k + 1)
            longest = top_cr + k + 1
            ctx = sum_prompt + sum_a + b * k
            hist = sum_hr + nh * k
            if young:
                corr = self._young_correction(young, k)
                if corr:
                    ctx += corr
                    rows[k] = (b, 0, 0, b, 0, kv, kv, longest, hist, ctx, 0, 0)
            budget = max_tokens - b
            admitted: list[Entry] = []
            if waiting and budget > 0 and len(running) < max_seqs:
                sched._admit(admitted, budget)
                if len(running) > loop.peak_running:
                    loop.peak_running = len(running)
            if admitted:
                pf = Scheduler._shape(admitted)
                row = (
                    b + pf.num_reqs, pf.num_prefill_reqs, pf.prefill_tokens,
                    b + pf.decode_tokens, pf.draft_tokens, kv + pf.kv_read_tokens,
                    kv + pf.attn_pairs, max(longest, pf.max_kv_tokens),
                    hist + pf.history_tokens, ctx + pf.context_tokens, pf.new_reqs,
                    pf.finished_reqs,
                )  # fmt: skip
                rows[k] = row
                for e in admitted:
                    sched._launch(e)
                run.admitted[k] = admitted
                for e in admitted:
                    r = e.req
                    if not e.generates:  # a partial prompt chunk: the normal path continues it
                        chunk_done.setdefault(nd + k, []).append(r)
                        stop_after = True
                        continue
                    # after its prompt pass (a recompute after preemption includes the
                    # outputs it had): computed c, out o0 confirmed, one placeholder
                    o0 = r.num_output_tokens
                    c = e.start_pos + e.num_tokens
                    m = _Member(r, next_key, k, k + 1, k + r.output_len - o0, c - k - 1)
                    next_key += 1
                    m.hr = o0 - k
                    m.a = o0 - nd - k
                    m.s = nd + k
                    m.o0 = o0
                    run.members.append(m)
                    if m.end > m.j1:
                        join.setdefault(m.j1, []).append(m)
                        drop.setdefault(m.end, []).append(m)
                        first = m.j1 + len(r.block_ids) * bs - c
                        if first < m.end:
                            grow.setdefault(first, []).append(m)
                        if m.s > m.j1:
                            young.append(m)
                    done.setdefault(nd + m.end - 1, []).append(m)
                mx.set_row(row)
                (
                    c_sched, c_prep, c_launch, c_sample, c_draft, c_po, c_gpu, c_dgpu,
                    a_sched, a_prep, a_launch, a_sample, a_draft, a_po, c_graph,
                ) = vals = costs.all(mx)  # fmt: skip
                quick = quick_costs(vals) and spread is None
                if changed:
                    sh.set_decode(b)
                    const = costs.const(sh)
                reload = True  # the next decode step takes the decode costs again
                cur = mx
            else:
                if changed:
                    sh.set_decode(b)
                    const = costs.const(sh)
                    reload = True
                if reload:
                    (
                        c_sched, c_prep, c_launch, c_sample, c_draft, c_po, c_gpu, c_dgpu,
                        a_sched, a_prep, a_launch, a_sample, a_draft, a_po, c_graph,
                    ) = const  # fmt: skip
                    quick = costs.quick(b)
                    reload = False
                sh.kv_read_tokens = sh.attn_pairs = kv
                sh.max_kv_tokens = longest
                sh.history_tokens = hist
                sh.context_tokens = ctx
                cur = sh
            step = s0 + k
            # ---- launch_step. The phase blocks below are unrolled on purpose: a helper call per
            # phase costs ~0.3 us, ~30 % of this loop's time on the Azure hour (bench/sim_speed).
            if quick:  # the common case: only prep and the GPU pass vary, no GC in between
                sched0.append(cpu)
                cpu += c_sched
                sched1.append(cpu)
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
                d = c_dgpu if c_dgpu is not None else f_dgpu(cur) / 1e3
                gpu_free = counts + d if d > 0 else counts
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
            if k < nd:
                t = old_end[k]
                if t > cpu:
                    sync_step.append(old_step[k])
                    sync0.append(cpu)
                    cpu = t + wake
                    sync1.append(cpu)
            elif g_end[k - nd] > cpu:
                t = g_end[k - nd]
                sync_step.append(step - nd)
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
            chunks = chunk_done.pop(k, None)
            if chunks is not None:
                for r in chunks:
                    r.num_inflight_batches -= 1
            finished = done.pop(k, None)
            if finished is not None:
                self._finish(finished, k + 1, nd, cpu)
            k += 1
        run.n = k
        loop.cpu_s, loop.gpu_free_s = cpu, gpu_free
        return run

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
            sched._finish(r)
            if r.block_ids:
                sched.blocks.release(r)
            rec.finish(r.index, t)

    # ---- bulk bookkeeping ---------------------------------------------------------------------
    def _record(self, old: list[Pass], run: _Run) -> np.ndarray:
        rec = self.loop.rec
        n, nd = run.n, len(old)
        shapes = _shape_rows(run)
        s0 = rec.add_steps(
            shapes,
            {
                P.SCHEDULE: (run.sched0[:n], run.sched1[:n]),
                P.PREPARE_INPUTS: (run.sched1[:n], run.prep1[:n]),
                P.LAUNCH: (run.prep1[:n], run.launch1[:n]),
                P.SAMPLE: (run.launch1[:n], run.sample1[:n]),
                P.DRAFT: (run.sample1[:n], run.draft1[:n]),
            },
        )
        po0, po1 = run.po0, run.po1
        for k, p in enumerate(old[:n]):
            rec.phase(p.step, P.PROCESS_OUTPUTS, po0[k], po1[k])
            rec.gpu(p.step, p.gpu_start_s, p.gpu_end_s)
        done = n - nd  # launched steps completed in the segment
        if done > 0:
            rec.phases(s0, P.PROCESS_OUTPUTS, po0[nd:n], po1[nd:n])
            rec.gpus(s0, run.gpu_start[:done], run.gpu_end[:done])
        if run.sync_step:
            rec.syncs(run.sync_step, run.sync0, run.sync1)
        for start_s, dur_s, gen, phase, step in run.pauses:
            rec.gc_pause(start_s, dur_s, gen, phase, step)
        for k, p in enumerate(old[:n]):
            rec.tokens_each([e.req.index for e in p.batch.entries], po1[k : k + 1])
        rows, starts, stops = [], [], []
        for m in run.members:
            # its passes are launches l0 .. end - 1, completed in iterations nd + l
            stop = min(nd + m.end, n)
            if nd + m.l0 < stop:
                rows.append(m.req.index)
                starts.append(nd + m.l0)
                stops.append(stop)
        rec.tokens_ranges(rows, starts, stops, po1)
        if self.loop.progress is not None:
            self.loop.progress(s0 + done - 1 if done > 0 else old[n - 1].step)
        return shapes

    def _write_back(self, old: list[Pass], run: _Run, shapes: np.ndarray) -> None:
        """Leave requests, the scheduler and the loop as the step-by-step path would have."""
        from sim.loop import Pass

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
            g0, gc_, g1 = run.gpu_start[k], run.gpu_counts[k], run.gpu_end[k]
            inflight.append(Pass(batch, s0 + k, run.launch1[k], g0, gc_, g1))
        loop.inflight = inflight
        if loop.check:
            sched.check_invariants()


def _key(m: _Member) -> int:
    return m.key


def _shape_rows(run: _Run) -> np.ndarray:
    """(n, len(SHAPE_FIELDS)) int64: the decode pieces evaluated at every launch, then the
    launches whose shape was written out."""
    n = run.n
    p = np.array([x for x in run.pieces if x[0] < n], dtype=np.int64).reshape(-1, 7)
    lengths = np.diff(np.append(p[:, 0], n))
    b, sum_cr, top_cr, sum_hr, nh, sum_pa = np.repeat(p[:, 1:], lengths, axis=0).T
    k = np.arange(n, dtype=np.int64)
    out = np.zeros((n, len(SHAPE_FIELDS)), dtype=np.int64)
    out[:, 0] = out[:, 3] = b  # num_reqs, decode_tokens
    out[:, 5] = out[:, 6] = sum_cr + b * (k + 1)  # kv_read_tokens, attn_pairs
    out[:, 7] = top_cr + k + 1  # max_kv_tokens
    out[:, 8] = sum_hr + nh * k  # history_tokens
    out[:, 9] = sum_pa + b * k  # context_tokens
    for i, row in run.rows.items():
        if i < n:
            out[i] = row
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
