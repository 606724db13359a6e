"""The shared scheduling policy: invariants under random in-flight depths, acceptance,
preemption and prefix sharing; every request gets exactly output_len tokens."""

from __future__ import annotations

import random
from collections import deque

import pytest
from helpers import sched_cfg

from bubblesim.core.policy import Scheduler
from bubblesim.core.request import Request, Status


def drive(
    sched: Scheduler,
    reqs: list[Request],
    depth: int,
    rng: random.Random,
    accept: float = 0.5,
    max_steps: int = 100_000,
) -> dict[int, int]:
    """Run a loop with `depth` batches in flight; returns tokens emitted per request."""
    for r in reqs:
        sched.add(r)
    inflight: deque = deque()
    got = {r.index: 0 for r in reqs}
    steps = 0
    while sched.has_unfinished or inflight:
        steps += 1
        assert steps < max_steps, "no progress"
        batch = sched.schedule() if len(inflight) < depth else None
        if batch is not None:
            inflight.append(batch)
        sched.check_invariants()
        if batch is None or len(inflight) >= depth:
            assert inflight, "nothing scheduled and nothing in flight: deadlock"
            done = inflight.popleft()
            emitted = []
            for e in done.entries:
                n = 1
                while n <= e.num_drafts and rng.random() < accept:
                    n += 1
                emitted.append(n)
            for e, n in zip(done.entries, sched.emitted_tokens(done, emitted)):
                got[e.req.index] += n
            sched.complete(done, emitted)
            sched.check_invariants()
    return got


def random_requests(rng: random.Random, n: int, max_prompt=40, max_out=30, share=False):
    reqs = []
    for i in range(n):
        p = rng.randint(1, max_prompt)
        pid = rng.choice([None, 1, 2]) if share else None
        reqs.append(
            Request(
                i,
                f"r{i}",
                0.0,
                p,
                rng.randint(1, max_out),
                prefix_id=pid,
                prefix_len=rng.randint(0, p) if pid else 0,
            )
        )
    return reqs


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("spec_k", [0, 3])
@pytest.mark.parametrize("seed", range(4))
def test_exact_lengths_and_invariants(depth, spec_k, seed):
    rng = random.Random(seed)
    reqs = random_requests(rng, 30, share=True)
    sched = Scheduler(sched_cfg(spec_k=spec_k, num_blocks=40))
    got = drive(sched, reqs, depth, rng)
    for r in reqs:
        assert r.status == Status.FINISHED
        assert got[r.index] == r.output_len == r.num_output_tokens
        assert not r.block_ids
    assert sched.blocks.num_free == sched.cfg.num_blocks


def test_preemption_under_tiny_kv_budget():
    rng = random.Random(7)
    reqs = [Request(i, i, 0.0, 20, 40) for i in range(6)]
    sched = Scheduler(sched_cfg(num_blocks=30, max_num_seqs=6))
    got = drive(sched, reqs, 2, rng)
    assert sched.num_preemptions > 0
    assert all(got[r.index] == 40 for r in reqs)


def test_chunked_prefill_respects_budget():
    sched = Scheduler(sched_cfg(max_num_batched_tokens=16, num_blocks=100))
    sched.add(Request(0, 0, 0.0, 50, 5))
    chunks = []
    while True:
        b = sched.schedule()
        assert b.shape.num_tokens <= 16
        chunks.append(b.entries[0].num_tokens)
        sched.complete(b, [1])
        if b.entries[0].generates:
            break
    assert chunks == [16, 16, 16, 2]


def test_no_chunked_prefill_refuses_oversized_prompt():
    sched = Scheduler(sched_cfg(chunked_prefill=False, max_num_batched_tokens=16))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add(Request(0, "big", 0.0, 30, 5))


def test_request_beyond_cache_is_refused_with_reason():
    sched = Scheduler(sched_cfg(num_blocks=4, block_size=4))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(Request(0, "x", 0.0, 10, 10))


def test_prefix_cache_hit_skips_shared_blocks():
    sched = Scheduler(sched_cfg(num_blocks=100, max_num_batched_tokens=512))
    a = Request(0, "a", 0.0, 40, 2, prefix_id="sys", prefix_len=32)
    sched.add(a)
    b1 = sched.schedule()
    sched.complete(b1, [1])
    b = Request(1, "b", 0.0, 40, 2, prefix_id="sys", prefix_len=32)
    sched.add(b)
    batch = sched.schedule()
    e = [e for e in batch.entries if e.req is b][0]
    assert b.num_cached_tokens == 32 and e.start_pos == 32 and e.num_tokens == 8
    assert b.block_ids[:8] == a.block_ids[:8]
    sched.check_invariants()


def test_prefix_cache_from_token_ids():
    sched = Scheduler(sched_cfg(num_blocks=100, max_num_batched_tokens=512))
    ids = list(range(100, 120))
    a = Request(0, "a", 0.0, 20, 2, prompt_ids=ids)
    sched.add(a)
    sched.complete(sched.schedule(), [1])
    b = Request(1, "b", 0.0, 20, 2, prompt_ids=ids[:12] + [1] * 8)
    sched.add(b)
    sched.schedule()
    assert b.num_cached_tokens == 12


def test_depth_two_schedules_on_placeholders():
    """With a batch in flight, a decoding request is scheduled again on its placeholder."""
    sched = Scheduler(sched_cfg())
    r = Request(0, 0, 0.0, 4, 3)
    sched.add(r)
    b0 = sched.schedule()
    b1 = sched.schedule()  # prefill in flight: decode on the first placeholder
    assert b1 is not None and b1.entries[0].start_pos == 4
    b2 = sched.schedule()
    assert b2 is not None and b2.entries[0].start_pos == 5
    assert sched.schedule() is None  # three in flight will surely finish all 3 tokens
    for b in (b0, b1, b2):
        sched.complete(b, [1])
    assert r.status == Status.FINISHED and r.num_output_tokens == 3


def test_drafts_capped_by_remaining_output():
    sched = Scheduler(sched_cfg(spec_k=4))
    r = Request(0, 0, 0.0, 4, 3)
    sched.add(r)
    sched.complete(sched.schedule(), [1])
    b = sched.schedule()
    assert b.entries[0].num_drafts == 1  # 2 tokens left: 1 + 1 draft
    sched.complete(b, [2])
    assert r.status == Status.FINISHED


def test_rejected_drafts_rewind_computed_tokens():
    sched = Scheduler(sched_cfg(spec_k=3))
    r = Request(0, 0, 0.0, 8, 20)
    sched.add(r)
    sched.complete(sched.schedule(), [1])
    b = sched.schedule()
    assert r.num_computed_tokens == 8 + 4
    sched.complete(b, [2])  # one draft accepted + bonus
    assert r.num_computed_tokens == 10 and r.num_output_tokens == 3
