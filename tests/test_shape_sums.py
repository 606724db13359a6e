"""`bubblesim.core.shape.shape_of` states how a step's rows sum into its BatchShape: the
scheduler's own
shapes (`Scheduler.schedule`) are exactly `shape_of` of its entries, under chunked prefill,
prefix caching, drafts, needs_history requests, preemption and two batches in flight."""

from __future__ import annotations

import random
from collections import deque

import pytest
from helpers import sched_cfg

from bubblesim.core.policy import Scheduler
from bubblesim.core.policy.scheduler import Entry
from bubblesim.core.request import Request
from bubblesim.core.shape import BatchShape, ShapeRow, attn_pairs, shape_of


def row(e: Entry) -> ShapeRow:
    """The row the scheduler's entry is, read right after `schedule()` returned it: the shape
    is taken before the launch added the entry's 1 + drafts placeholders."""
    r = e.req
    placeholders_before = r.num_placeholders - (1 + e.num_drafts if e.generates else 0)
    return ShapeRow(
        e.start_pos,
        e.num_tokens,
        e.is_prefill,
        num_drafts=0 if e.is_prefill else e.num_drafts,
        is_new=e.is_prefill and e.start_pos == r.num_cached_tokens,
        history_tokens=r.num_output_tokens + placeholders_before
        if r.needs_history and e.generates
        else 0,
        context_tokens=r.prompt_len + r.num_output_tokens,
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(spec_k=3),
        dict(num_blocks=48, prefix_caching=True),  # tight: preempts
        dict(chunked_prefill=False, max_num_batched_tokens=256, num_blocks=400),
    ],
)
def test_the_schedulers_shapes_are_shape_of_its_entries(kw: dict[str, object]):
    sched = Scheduler(sched_cfg(**kw))
    rng = random.Random(7)
    for i in range(40):
        sched.add(
            Request(
                i,
                f"r{i}",
                0.0,
                rng.randint(2, 120),
                rng.randint(1, 30),
                needs_history=i % 3 == 0,
                prefix_id=i % 4,
                prefix_len=rng.choice([0, 8, 16]),
            )
        )
    in_flight: deque = deque()
    steps = preempted = drafts = history = new = 0
    while sched.has_unfinished:
        batch = sched.schedule()
        if batch is not None:
            assert batch.shape == shape_of(row(e) for e in batch.entries)
            preempted += len(batch.preempted)
            drafts += batch.shape.draft_tokens
            history += batch.shape.history_tokens
            new += batch.shape.new_reqs
            in_flight.append(batch)
            steps += 1
        if len(in_flight) == 2 or (batch is None and in_flight):  # two batches in flight
            done = in_flight.popleft()
            sched.complete(done, [1 + e.num_drafts for e in done.entries])
    assert steps > 30 and history > 0 and new >= 40
    assert (drafts > 0) == (kw.get("spec_k", 0) > 0)
    if kw.get("num_blocks") == 48:
        assert preempted > 0  # the tight case exercised preemption


def test_shape_of_counts_and_sums():
    rows = [
        ShapeRow(0, 5, True, is_new=True, context_tokens=5),
        ShapeRow(9, 3, False, num_drafts=2, history_tokens=4, context_tokens=10),
    ]
    assert shape_of(rows, finished_reqs=1) == BatchShape(
        num_reqs=2,
        num_prefill_reqs=1,
        prefill_tokens=5,
        decode_tokens=3,
        draft_tokens=2,
        kv_read_tokens=5 + 12,
        attn_pairs=15 + (10 + 11 + 12),
        max_kv_tokens=12,
        history_tokens=4,
        context_tokens=15,
        new_reqs=1,
        finished_reqs=1,
    )
    assert attn_pairs(0, 1) == 1 and attn_pairs(9, 3) == 33
    assert shape_of([]) == BatchShape()
