"""Fast-forward: a run of identical decode steps computed in bulk, exactly as the loop would.

At the top of a loop iteration the next steps are all alike when:
- no speculative decoding, and the loop reads its own arrivals;
- every running request is decoding, and the batches in flight (depth - 1 of them) only hold
  running requests, each generating one token;
- nothing can be admitted: the waiting queue is empty and the segment ends before the first
  arrival a schedule would see, or nothing could be admitted anyway (max_num_seqs or the token
  budget is full);
- no request is skipped for finishing, none finishes, and the KV blocks the segment allocates
  are free (no preemption).
Then iteration k (k = 0 .. n-1) launches step s0 + k, a decode of every running request r at
position c_r + k, and completes the oldest pass in flight. The shape's fields are constant
except four that grow by a fixed amount per step, so the cost model is called on one mutable
shape, and not at all for costs that read none of the four (`_Costs`). The CPU clock with its
GC pauses and sync waits, and the GPU stream's max(ready, previous end), run as a scalar loop
with the same float operations in the same order as `SimLoop.launch_step` and
`SimLoop.complete_step`, so the result is the same bit for bit. At the end the recorder gets
the steps in bulk, the policy state is advanced in bulk (blocks allocated through the block
manager in per-step order) and the passes left in flight become real `ScheduledBatch`
objects, so the normal path continues from there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core import phases as P
from core.policy import Entry, ScheduledBatch
from core.request import Request
from core.shape import SHAPE_FIELDS, BatchShape

if TYPE_CHECKING:
    from sim.loop import Pass, SimLoop

MAX_SEGMENT_STEPS = 1 << 16  # bounds the lists of one segment
VARYING = ("kv_read_tokens", "attn_pairs", "history_tokens", "context_tokens")
_INF = float("inf")
# a decode step's shape row is written out positionally below
assert SHAPE_FIELDS == (
    "num_reqs", "num_prefill_reqs", "prefill_tokens", "decode_tokens", "draft_tokens",
    "kv_read_tokens", "attn_pairs", "history_tokens", "context_tokens", "new_reqs",
    "finished_reqs",
), SHAPE_FIELDS  # fmt: skip
CostFn = Callable[[Any], Any]


class _Shape:
    """A mutable BatchShape stand-in: the shape of a segment's current step (batch size b)."""

    __slots__ = (*SHAPE_FIELDS, "num_tokens", "is_pure_decode")

    def __init__(self, b: int) -> None:
        self.num_reqs = b
        self.num_prefill_reqs = 0
        self.prefill_tokens = 0
        self.decode_tokens = b
        self.draft_tokens = 0
        self.kv_read_tokens = 0  # varying: VARYING lists these four
        self.attn_pairs = 0
        self.history_tokens = 0
        self.context_tokens = 0
        self.new_reqs = 0
        self.finished_reqs = 0
        self.num_tokens = b
        self.is_pure_decode = True


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
    """The per-step costs of a segment of batch size b: `fns[i]` is a function of the shape,
    `const[i]` its value when it reads no varying field (the same for every step), else None."""

    NAMES = (
        *(f"{p}_s" for p in P.CPU_PHASES),  # CPU phase seconds (launch incl. launch_ms)
        "gpu_s",
        "draft_gpu_s",
        *(f"{p}_alloc" for p in P.CPU_PHASES),  # net tracked objects (GC model)
    )

    def __init__(self, loop: SimLoop) -> None:
        cost, graphs = loop.cost, loop._graphs

        def phase_s(p: str) -> CostFn:
            if p == P.LAUNCH:  # SimLoop._phase_time: the launch phase includes launch_ms
                return lambda s: (cost.cpu_phase_ms(p, s) + cost.launch_ms(s, graphs)) / 1e3
            return lambda s: cost.cpu_phase_ms(p, s) / 1e3

        def alloc(p: str) -> CostFn:
            return lambda s: cost.alloc_objects(p, s)

        fns: list[CostFn] = [phase_s(p) for p in P.CPU_PHASES]
        fns.append(lambda s: cost.gpu_pass_ms(s) / 1e3)
        fns.append(lambda s: cost.draft_gpu_ms(s) / 1e3)
        fns.extend(alloc(p) for p in P.CPU_PHASES)
        self.fns = fns
        self._const: dict[int, list[Any]] = {}

    def const(self, shape: _Shape) -> list[Any]:
        """Per cost: its value for every step of a segment of this batch size, or None when it
        reads a varying field. Cached per batch size: the constant fields are functions of it."""
        b = shape.num_reqs
        out = self._const.get(b)
        if out is None:
            out = []
            for fn in self.fns:
                probe = _Probe(shape)
                fn(probe)
                out.append(None if probe.varying else fn(shape))
            self._const[b] = out
        return out


@dataclass
class _Run:
    """What a segment computed, per launched step k unless said otherwise."""

    n: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    sched0: list[float] = field(default_factory=list)
    sched1: list[float] = field(default_factory=list)
    prep1: list[float] = field(default_factory=list)
    launch1: list[float] = field(default_factory=list)
    sample1: list[float] = field(default_factory=list)
    draft1: list[float] = field(default_factory=list)
    gpu_start: list[float] = field(default_factory=list)
    gpu_counts: list[float] = field(default_factory=list)
    gpu_end: list[float] = field(default_factory=list)
    po0: list[float] = field(default_factory=list)  # index k: the pass completed in iteration k
    po1: list[float] = field(default_factory=list)
    sync_step: list[int] = field(default_factory=list)
    sync0: list[float] = field(default_factory=list)
    sync1: list[float] = field(default_factory=list)
    pauses: list[tuple[float, float, int, str, int]] = field(default_factory=list)


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

    # ---- when ---------------------------------------------------------------------------------
    def run_segment(self) -> bool:
        """Run a segment from the loop's current state; False (nothing done) if none applies."""
        loop = self.loop
        sched = loop.sched
        running = sched.running
        b = len(running)
        if not b or len(loop.inflight) != loop.depth - 1 or b > self.max_tokens:
            return False
        can_admit = b < self.max_seqs and b < self.max_tokens
        if can_admit and sched.waiting:
            return False
        old = list(loop.inflight)
        for p in old:
            for e in p.batch.entries:
                if not e.generates or e.num_drafts:
                    return False
        n_max = MAX_SEGMENT_STEPS
        for r in running:
            ph = r.num_placeholders
            out = r.num_output_tokens
            if r.prompt_len + out + ph - r.num_computed_tokens != 1 or out + ph == 0:
                return False  # not decoding
            # launch k needs outputs_guaranteed = out + inflight_gen + k < output_len
            left = r.output_len - out - r.num_inflight_gen
            if left < n_max:
                n_max = left
        if loop.depth == 1:
            n_max -= 1  # iteration k also completes launch k: it must not finish the request
        if n_max < 1:
            return False
        allocs, n_max = self._block_plan(running, n_max)
        if n_max < 1:
            return False
        next_arrival_s = loop.next_arrival_s() if can_admit else _INF
        run = self._simulate(old, running, n_max, next_arrival_s)
        self._record(old, running, run)
        self._apply(old, running, allocs, run)
        self.num_segments += 1
        self.num_steps += run.n
        return True

    def _block_plan(self, running: list[Request], n_max: int) -> tuple[list[tuple[int, int]], int]:
        """(iteration, running index) of every block allocation, in per-step order, and n_max
        cut so that they all fit in the free blocks (a shortfall would preempt)."""
        bs = self.block_size
        events: list[tuple[int, int]] = []
        for i, r in enumerate(running):
            # launch k writes position c + k: it needs a new block once c + k + 1 > capacity
            first = len(r.block_ids) * bs - r.num_computed_tokens
            if first < 0:
                return [], 0  # fewer blocks than computed tokens: leave it to the normal path
            if first < n_max:
                events.extend((k, i) for k in range(first, n_max, bs))
        events.sort()
        free = self.loop.sched.blocks.num_free
        if len(events) > free:
            n_max = events[free][0]
            del events[free:]
        return events, n_max

    # ---- the steps ----------------------------------------------------------------------------
    def _simulate(
        self, old: list[Pass], running: list[Request], n_max: int, next_arrival_s: float
    ) -> _Run:
        """SimLoop.launch_step + complete_step, n times, on plain floats."""
        loop = self.loop
        gc, cost = loop.gc, loop.cost
        gc_allocate = gc.allocate
        b = len(running)
        nd = len(old)  # completed in iterations 0 .. nd - 1, before any launched step
        s0 = loop.rec.num_steps
        kv = sum(r.num_computed_tokens for r in running) + b  # of step 0
        hist_reqs = [r for r in running if r.needs_history]
        nh = len(hist_reqs)
        hist = sum(r.num_output_tokens + r.num_placeholders for r in hist_reqs)
        # context = prompts + confirmed outputs: + each completed pass's size
        ctx_head = [sum(r.prompt_len + r.num_output_tokens for r in running)]
        for p in old:
            ctx_head.append(ctx_head[-1] + len(p.batch.entries))
        ctx = ctx_head[0]
        sh = _Shape(b)
        sh.kv_read_tokens = sh.attn_pairs = kv
        sh.history_tokens = hist
        sh.context_tokens = ctx
        (
            c_sched, c_prep, c_launch, c_sample, c_draft, c_po, c_gpu, c_dgpu,
            a_sched, a_prep, a_launch, a_sample, a_draft, a_po,
        ) = self.costs.const(sh)  # fmt: skip
        f = self.costs.fns
        f_sched, f_prep, f_launch, f_sample, f_draft, f_po, f_gpu, f_dgpu = f[:8]
        fa_sched, fa_prep, fa_launch, fa_sample, fa_draft, fa_po = f[8:]
        # process_outputs of the completed pass: old passes first, then launched step k - nd
        po_s = [cost.cpu_phase_ms(P.PROCESS_OUTPUTS, p.batch.shape) / 1e3 for p in old]
        po_a = [cost.alloc_objects(P.PROCESS_OUTPUTS, p.batch.shape) for p in old]
        done_s = [p.gpu_end_s for p in old]
        done_step = [p.step for p in old]
        run = _Run()
        shapes = run.shapes
        sched0, sched1, prep1 = run.sched0, run.sched1, run.prep1
        launch1, sample1, draft1 = run.launch1, run.sample1, run.draft1
        g_start, g_counts, g_end = run.gpu_start, run.gpu_counts, run.gpu_end
        po0, po1, pauses = run.po0, run.po1, run.pauses
        sync_step, sync0, sync1 = run.sync_step, run.sync0, run.sync1
        pause_at = pauses.append
        cpu, gpu_free = loop.cpu_s, loop.gpu_free_s
        n = n_max
        for k in range(n_max):
            if k:
                if next_arrival_s <= cpu:
                    n = k  # an arrival is visible at this schedule: the normal path admits it
                    break
                kv += b
                hist += nh
                ctx = ctx_head[k] if k <= nd else ctx + b
                sh.kv_read_tokens = sh.attn_pairs = kv
                sh.history_tokens = hist
                sh.context_tokens = ctx
            shapes.append((b, 0, 0, b, 0, kv, kv, hist, ctx, 0, 0))
            step = s0 + k
            # launch_step
            sched0.append(cpu)
            cpu += c_sched if c_sched is not None else f_sched(sh)
            a = a_sched if a_sched is not None else fa_sched(sh)
            if a > 0:
                pause = gc_allocate(a)
                if pause:  # before add_step: the pause counts on the previous step
                    pause_at((cpu, pause, gc.last_generation, P.SCHEDULE, step - 1))
                    cpu += pause
            sched1.append(cpu)
            cpu += c_prep if c_prep is not None else f_prep(sh)
            a = a_prep if a_prep is not None else fa_prep(sh)
            if a > 0:
                pause = gc_allocate(a)
                if pause:
                    pause_at((cpu, pause, gc.last_generation, P.PREPARE_INPUTS, step))
                    cpu += pause
            prep1.append(cpu)
            cpu += c_launch if c_launch is not None else f_launch(sh)
            a = a_launch if a_launch is not None else fa_launch(sh)
            if a > 0:
                pause = gc_allocate(a)
                if pause:
                    pause_at((cpu, pause, gc.last_generation, P.LAUNCH, step))
                    cpu += pause
            launch1.append(cpu)
            start = cpu if cpu > gpu_free else gpu_free
            counts = start + (c_gpu if c_gpu is not None else f_gpu(sh))
            d = c_dgpu if c_dgpu is not None else f_dgpu(sh)
            gpu_free = counts + d if d > 0 else counts
            g_start.append(start)
            g_counts.append(counts)
            g_end.append(gpu_free)
            done_s.append(gpu_free)
            done_step.append(step)
            cpu += c_sample if c_sample is not None else f_sample(sh)
            a = a_sample if a_sample is not None else fa_sample(sh)
            if a > 0:
                pause = gc_allocate(a)
                if pause:
                    pause_at((cpu, pause, gc.last_generation, P.SAMPLE, step))
                    cpu += pause
            sample1.append(cpu)
            cpu += c_draft if c_draft is not None else f_draft(sh)
            a = a_draft if a_draft is not None else fa_draft(sh)
            if a > 0:
                pause = gc_allocate(a)
                if pause:
                    pause_at((cpu, pause, gc.last_generation, P.DRAFT, step))
                    cpu += pause
            draft1.append(cpu)
            po_s.append(c_po if c_po is not None else f_po(sh))
            po_a.append(a_po if a_po is not None else fa_po(sh))
            # complete_step of the oldest pass in flight
            done = done_s[k]
            if done > cpu:
                sync_step.append(done_step[k])
                sync0.append(cpu)
                sync1.append(done)
                cpu = done
            po0.append(cpu)
            cpu += po_s[k]
            a = po_a[k]
            if a > 0:
                pause = gc_allocate(a)
                if pause:
                    pause_at((cpu, pause, gc.last_generation, P.PROCESS_OUTPUTS, step))
                    cpu += pause
            po1.append(cpu)
        run.n = n
        loop.cpu_s, loop.gpu_free_s = cpu, gpu_free
        return run

    # ---- bulk bookkeeping ---------------------------------------------------------------------
    def _record(self, old: list[Pass], running: list[Request], run: _Run) -> None:
        rec = self.loop.rec
        n, nd = run.n, len(old)
        s0 = rec.add_steps(
            run.shapes[:n],
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
        if done > 0:
            rec.tokens_each([r.index for r in running], po1[nd:n])
        if self.loop.progress is not None:
            self.loop.progress(s0 + done - 1 if done > 0 else old[n - 1].step)

    def _apply(
        self, old: list[Pass], running: list[Request], allocs: list[tuple[int, int]], run: _Run
    ) -> None:
        """Leave the policy as n calls of schedule() and complete() would have."""
        from sim.loop import Pass

        loop = self.loop
        sched = loop.sched
        n, nd = run.n, len(old)
        for p in old[:n]:
            sched.complete(p.batch, [1] * len(p.batch.entries))
        blocks = sched.blocks
        c0 = [r.num_computed_tokens for r in running]
        for k, i in allocs:
            if k >= n:
                break
            ok = blocks.allocate(running[i], c0[i] + k + 1)
            assert ok, "fast-forward: block plan out of date"
        left = min(n, nd)  # launched passes still in flight
        done = n - left
        for r in running:
            r.num_computed_tokens += n
            r.num_output_tokens += done
            r.num_placeholders += left
            r.num_inflight_gen += left
            r.num_inflight_batches += left
        first = sched.num_steps
        sched.num_steps += n
        inflight: deque[Pass] = deque(old[n:])
        s0 = loop.rec.num_steps - n
        for k in range(done, n):
            shape = BatchShape(**dict(zip(SHAPE_FIELDS, run.shapes[k], strict=True)))
            entries = [Entry(r, c + k, 1, 0, True, False) for r, c in zip(running, c0)]
            batch = ScheduledBatch(first + k, entries, shape)
            inflight.append(
                Pass(
                    batch,
                    s0 + k,
                    run.launch1[k],
                    run.gpu_start[k],
                    run.gpu_counts[k],
                    run.gpu_end[k],
                )
            )
        loop.inflight = inflight
        if loop.check:
            sched.check_invariants()
