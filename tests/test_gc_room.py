"""GCModel.room: taking objects off it while they fit (what sim.clock.StepClock.step does
instead of calling allocate) leaves the model where `allocate` would, collection for
collection."""

from __future__ import annotations

import random

import pytest

from bubblesim.core.config import load_config
from sim.cost import CostModel
from sim.gcmodel import GCModel


@pytest.mark.parametrize("model", [True, False])
def test_room_shortcut_matches_allocate(model: bool) -> None:
    cfg = load_config(None, [f"gc.model={str(model).lower()}"])
    cost = CostModel(cfg)
    a = GCModel(cfg.gc, cfg.gc_freeze, cost.gc_pause_ms)
    b = GCModel(cfg.gc, cfg.gc_freeze, cost.gc_pause_ms)
    rng = random.Random(0)
    pauses_a, pauses_b = [], []
    for _ in range(20_000):
        objs = rng.choice((0, 1, 2, 5, 40, 300, 2000))
        pauses_a.append((a.allocate(objs), a.last_generation))
        if 0 < objs <= b.room:
            b.room -= objs
            pauses_b.append((0.0, b.last_generation))
        else:
            pauses_b.append((b.allocate(objs), b.last_generation))
        assert a.count0 == b.count0
    assert pauses_a == pauses_b
    assert a.num_collections == b.num_collections
    assert (sum(a.num_collections) > 100) == model
