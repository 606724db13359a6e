"""BlockManager.allocate_one (the fast path's grow of a single decode) hands out the same id as
`allocate_next((req,))`, in the plain and the linked representation, and refuses without a
change when no block is free; StepCosts.all gives `fns` called on the shape, to the bit."""

from __future__ import annotations

import random

import pytest

from bubblesim.core.config import load_config
from bubblesim.core.policy.blocks import BlockManager
from bubblesim.core.request import Request
from sim.clock import NUM_SECONDS
from sim.run import load_cost_model
from sim.stepcosts import StepCosts, StepShape


def _drive(bm: BlockManager, seed: int, one: bool, link: bool) -> list[object]:
    """Random admissions, single grows and releases; returns every id list and free count."""
    rng = random.Random(seed)
    live: list[Request] = []
    seen: list[object] = []
    if link:
        bm.free  # noqa: B018 (switches to the linked representation)
    for i in range(600):
        op = rng.random()
        if op < 0.3 or not live:
            r = Request(i, i, 0.0, rng.randint(1, 100), 10)
            if bm.allocate(r, r.prompt_len):
                live.append(r)
        elif op < 0.8:
            r = rng.choice(live)
            seen.append(bm.allocate_one(r) if one else bm.allocate_next((r,)))
        else:
            bm.release(live.pop(rng.randrange(len(live))))
        seen.append((bm.num_free, [list(r.block_ids) for r in live]))
    return seen


@pytest.mark.parametrize("link", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_allocate_one_is_allocate_next(seed: int, link: bool) -> None:
    runs = [_drive(BlockManager(120, 16), seed, one, link) for one in (False, True)]
    assert runs[0] == runs[1]
    assert False in runs[0]  # the cache ran short at least once


def test_allocate_one_refuses_without_change() -> None:
    bm = BlockManager(2, 16)
    a = Request(0, 0, 0.0, 32, 4)
    assert bm.allocate(a, 32)
    assert not bm.allocate_one(a)
    assert (a.block_ids, bm.num_free) == ([0, 1], 0)


def test_all_is_every_cost_called() -> None:
    cfg = load_config(None, ["model=llama3-8b", "gpu=h100"])
    costs = StepCosts(load_cost_model(cfg), cfg.cuda_graphs)
    rng = random.Random(0)
    for _ in range(200):
        sh = StepShape()
        b, pf = rng.randint(1, 64), rng.randint(0, 3)
        tokens = rng.randint(pf, 4000)
        kv = rng.randint(b, 200_000)
        sh.set_row((b + pf, pf, tokens, b, 0, kv, kv, rng.randint(1, 8000), 0, kv, pf, 0))
        want = [fn(sh) / 1e3 if i < NUM_SECONDS else fn(sh) for i, fn in enumerate(costs.fns)]
        assert costs.all(sh) == want
