"""BlockManager's plain representation (no content hash registered yet) against the linked
one it switches to: the same ids handed out in the same order, the same free counts and the
same state once linked, under random allocate / release / scatter / prefix-cache operations."""

from __future__ import annotations

import random

import pytest

from bubblesim.core.policy.blocks import BlockManager
from bubblesim.core.request import Request


def _state(bm: BlockManager) -> tuple[object, ...]:
    free = bm.free  # links the manager
    order, b = [], free.head
    while b != -1:
        order.append(b)
        b = free.next[b]
    return free.fresh, order, list(bm.refcount), list(bm.block_hash), free.size


def _drive(bm: BlockManager, seed: int, steps: int, prefixes: bool) -> list[object]:
    """Random operations on `bm`; returns everything observable along the way."""
    rng = random.Random(seed)
    live: list[Request] = []
    seen: list[object] = []
    for i in range(steps):
        op = rng.random()
        if op < 0.45 or not live:
            pid = rng.randrange(3) if prefixes and rng.random() < 0.5 else None
            r = Request(i, i, 0.0, rng.randint(1, 200), 10, prefix_id=pid, prefix_len=120)
            cached = bm.match_prefix(r)
            ok = bm.allocate(r, rng.randint(1, 260))
            seen.append((cached, ok, list(r.block_ids)))
            if ok:
                bm.cache_blocks(r, r.prompt_len)
                live.append(r)
            else:
                bm.release(r)
        elif op < 0.75:
            r = rng.choice(live)
            ok = bm.allocate(r, len(r.block_ids) * bm.block_size + rng.randint(1, 40))
            seen.append((ok, list(r.block_ids)))
        elif op < 0.98:
            r = live.pop(rng.randrange(len(live)))
            bm.release(r)
        else:
            bm.scatter_free(rng.randrange(100))
        seen.append(bm.num_free)
        bm.check_invariants(live)
    return seen


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefixes", [False, True])
def test_plain_and_linked_hand_out_the_same_blocks(seed: int, prefixes: bool) -> None:
    plain = BlockManager(300, 16, prefix_caching=True)
    linked = BlockManager(300, 16, prefix_caching=True)
    linked.free  # noqa: B018 (reading it links the manager from the start)
    assert _drive(plain, seed, 600, prefixes) == _drive(linked, seed, 600, prefixes)
    assert _state(plain) == _state(linked)


def test_plain_until_a_hash_is_registered() -> None:
    bm = BlockManager(100, 16)
    r = Request(0, 0, 0.0, 50, 5)
    assert bm.allocate(r, 50) and r.block_ids == [0, 1, 2, 3]
    bm.cache_blocks(r, 50)  # no prefix: nothing to register
    assert not bm._linked
    bm.release(r)
    s = Request(1, 1, 0.0, 50, 5, prefix_id="p", prefix_len=48)
    assert bm.match_prefix(s) == 0
    assert bm.allocate(s, 50) and s.block_ids == [4, 5, 6, 7]  # fresh blocks first
    bm.cache_blocks(s, 50)
    assert bm._linked and len(bm.hash_to_block) == 3
    bm.check_invariants([s])


def test_linking_keeps_the_reuse_order() -> None:
    bm = BlockManager(8, 16, prefix_caching=False)
    a, b = Request(0, 0, 0.0, 1, 1), Request(1, 1, 0.0, 1, 1)
    assert bm.allocate(a, 48) and bm.allocate(b, 80)  # a: 0-2, b: 3-7
    bm.release(b)
    bm.release(a)  # queue: 7 6 5 4 3 2 1 0 (tail blocks first)
    order = _state(bm)[1]
    assert order == [7, 6, 5, 4, 3, 2, 1, 0]


def test_plain_queue_compaction_keeps_the_order() -> None:
    """A small cache churned long enough that the plain queue drops its consumed front."""
    plain, linked = BlockManager(40, 16, False), BlockManager(40, 16, False)
    linked.free  # noqa: B018
    queued = 0
    release = plain.release

    def counting_release(r: Request) -> None:
        nonlocal queued
        queued += len(r.block_ids)
        release(r)

    plain.release = counting_release  # type: ignore[method-assign]
    assert _drive(plain, 9, 6000, False) == _drive(linked, 9, 6000, False)
    assert queued > 2 * 4096 and len(plain._queue) < 4096  # dropped its consumed front
    assert _state(plain) == _state(linked)
