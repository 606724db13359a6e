"""Speculative-decoding steps scheduled in fewer Python operations, with the same state changes
as `Scheduler.schedule`.

With drafts, every entry's accepted count is its own random draw (or n-gram match), so runs of
steps are not alike and `FastForward` does not apply. `SpecSteps.schedule()` stands in for
`Scheduler.schedule()` when every running request it reaches is decoding and the step's new KV
blocks fit (no preemption is possible): it plans each decode with the policy's own rule
(`Scheduler.plan`'s `num_drafts`), allocates blocks in running order, admits with
`Scheduler.admit`, takes `Scheduler.shape` and launches with `Scheduler.launch`, skipping the
general schedule's preemption bookkeeping. Otherwise it returns None before changing anything
and the caller runs `Scheduler.schedule()`. Replicas fed by a router use it too (nothing is
deferred: the general path can take over at any step).
tests/test_sim_fastforward.py runs spec configs with this on and off: equal to the bit.
"""

from __future__ import annotations

from bubblesim.core.policy import Entry, ScheduledBatch, Scheduler
from bubblesim.core.request import Status
from sim.fast.host import Host

_RUNNING = Status.RUNNING


class SpecSteps:
    def __init__(self, loop: Host) -> None:
        self.loop = loop
        cfg = loop.sched.cfg
        self.max_tokens = cfg.max_num_batched_tokens
        self.max_seqs = cfg.max_num_seqs
        self.block_size = cfg.block_size
        self.num_fast = 0  # steps scheduled here (tests: the path ran)

    def schedule(self) -> ScheduledBatch | None:
        """`Scheduler.schedule()` for a step of decodes (+ admissions) without preemption;
        None (nothing changed) when the general schedule must run."""
        sched = self.loop.sched
        running = sched.running
        bs = self.block_size
        budget = self.max_tokens
        entries: list[Entry] = []
        new_blocks = 0
        for r in running:  # no preemption below: the list does not change while we walk it
            if budget <= 0:
                break
            if r.outputs_guaranteed >= r.output_len:
                continue  # batches in flight will finish it (Scheduler.plan)
            if not r.in_decode or r.status != _RUNNING:
                return None  # a prefill chunk to continue: the general path
            c = r.num_computed_tokens
            d = sched.num_drafts(r, budget)
            nb = -(-(c + 1 + d) // bs) - len(r.block_ids)
            if nb > 0:
                new_blocks += nb
            entries.append(Entry(r, c, 1 + d, d, True, False))
            budget -= 1 + d
        if not entries or new_blocks > sched.blocks.num_free:
            return None  # nothing to decode, or a preemption: the general path
        allocate = sched.blocks.allocate
        for e in entries:  # fits: new_blocks <= free, allocated in running order
            total = e.start_pos + e.num_tokens
            if -(-total // bs) > len(e.req.block_ids):
                allocate(e.req, total)
        if sched.waiting and budget > 0 and len(running) < self.max_seqs:
            sched.admit(entries, budget)
        batch = ScheduledBatch(sched.num_steps, entries, Scheduler.shape(entries), [])
        for e in entries:
            sched.launch(e)
        sched.num_steps += 1
        self.num_fast += 1
        return batch
