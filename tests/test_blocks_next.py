"""BlockManager.allocate_next (one more block for each of several decodes, the fast path's
grows) hands out the same ids, in the same order, as `allocate` called for each in turn, in
the plain and the linked representation, and refuses without a change when blocks are short."""

from __future__ import annotations

import random

import pytest

from bubblesim.core.policy.blocks import BlockManager
from bubblesim.core.request import Request


def _drive(bm: BlockManager, seed: int, bulk: bool, link: bool) -> list[object]:
    """Random admissions, grows and releases; returns every id list and free count seen."""
    rng = random.Random(seed)
    live: list[Request] = []
    seen: list[object] = []
    if link:
        bm.free  # noqa: B018 (switches to the linked representation)
    for i in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            r = Request(i, i, 0.0, rng.randint(1, 100), 10)
            if bm.allocate(r, r.prompt_len):
                live.append(r)
        elif op < 0.8:
            grow = rng.sample(live, rng.randint(1, min(4, len(live))))
            if bulk:
                ok = bm.allocate_next(grow)
            else:
                ok = len(grow) <= bm.num_free
                if ok:
                    for r in grow:
                        assert bm.allocate(r, len(r.block_ids) * bm.block_size + 1)
            seen.append(ok)
        else:
            r = live.pop(rng.randrange(len(live)))
            bm.release(r)
        seen.append((bm.num_free, [list(r.block_ids) for r in live]))
    return seen


@pytest.mark.parametrize("link", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_allocate_next_is_allocate_in_turn(seed: int, link: bool) -> None:
    runs = [_drive(BlockManager(120, 16), seed, bulk, link) for bulk in (False, True)]
    assert runs[0] == runs[1]
    assert False in runs[0]  # the cache ran short at least once


def test_allocate_next_refuses_without_change() -> None:
    bm = BlockManager(3, 16)
    a, b = Request(0, 0, 0.0, 16, 4), Request(1, 1, 0.0, 16, 4)
    assert bm.allocate(a, 16) and bm.allocate(b, 16)
    assert not bm.allocate_next([a, b])
    assert (a.block_ids, b.block_ids, bm.num_free) == ([0], [1], 1)
    assert bm.allocate_next([b])
    assert (b.block_ids, bm.num_free) == ([1, 2], 0)
