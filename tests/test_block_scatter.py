"""BlockManager.scatter_free: the free blocks in a seeded random order (the layout `replay
shapes` times its batches over), the same set of free blocks, the same accounting."""

from __future__ import annotations

from bubblesim.core.policy.blocks import BlockManager
from bubblesim.core.request import Request


def _req(i: int) -> Request:
    return Request(index=i, request_id=i, arrival_s=0.0, prompt_len=100, output_len=10)


def test_scatter_keeps_the_free_set_and_hands_out_scattered_ids() -> None:
    bm = BlockManager(1000, 16, prefix_caching=False)
    a = _req(0)
    assert bm.allocate(a, 160)  # 10 fresh blocks: 0..9
    assert a.block_ids == list(range(10))
    bm.scatter_free(seed=3)
    assert bm.num_free == 990
    b = _req(1)
    assert bm.allocate(b, 320)
    assert len(b.block_ids) == 20 and not set(b.block_ids) & set(a.block_ids)
    assert sorted(b.block_ids) != list(range(10, 30))  # not a run of consecutive ids
    assert all(0 <= x < 1000 for x in b.block_ids)
    bm.release(b)
    bm.release(a)
    assert bm.num_free == 1000


def test_scatter_is_deterministic() -> None:
    ids = []
    for _ in range(2):
        bm = BlockManager(500, 16, prefix_caching=False)
        bm.scatter_free(seed=7)
        r = _req(0)
        assert bm.allocate(r, 16 * 12)
        ids.append(r.block_ids)
    assert ids[0] == ids[1]
