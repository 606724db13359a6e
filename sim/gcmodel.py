"""A model of CPython's generational garbage collector on the engine's CPU thread.

CPython (through 3.13) counts tracked-container allocations minus deallocations since the last
collection (`count0`). Past `threshold0` it collects generation 0; every `threshold1`-th young
collection is a generation-1 collection; every `threshold2`-th of those a full collection, but
only once the objects promoted since the last full collection exceed 25 % of the long-lived
ones. A pause costs in proportion to the objects it scans; `gc.freeze()` after start-up moves
the start-up heap to a permanent generation that is never scanned.

The engine feeds it the net tracked objects each CPU phase leaves alive (`allocate`), and the
objects that outlive a collection (request state) through `survive_fraction`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from bubblesim.core.config import GCConfig


class GCModel:
    def __init__(
        self,
        cfg: GCConfig,
        frozen: bool,
        pause_ms: Callable[[int, int], float],
        survive_fraction: float = 0.02,
    ) -> None:
        self.enabled = cfg.model
        self.t0, self.t1, self.t2 = cfg.threshold0, cfg.threshold1, cfg.threshold2
        self.pause_ms = pause_ms  # (generation, objects scanned) -> ms
        self.survive = survive_fraction
        # threshold0 - count0: the objects `allocate` takes before a collection (inf when off,
        # as it never collects). A caller may take `objects <= room` off it itself: that is
        # all `allocate` does then (sim.clock.StepClock.step, without the call).
        self.room: float = self.t0 if self.enabled else math.inf
        self.count1 = 0  # young collections since the last gen-1 collection
        self.count2 = 0  # gen-1 collections since the last full collection
        self.gen1_objects = 0
        # long-lived objects scanned by a full collection; frozen start-up heap is not
        self.long_lived = 0 if frozen else cfg.startup_objects
        self.pending = 0  # promoted to the old generation since the last full collection
        self.last_generation = -1
        self.num_collections = [0, 0, 0]

    def allocate(self, objects: int) -> float:
        """Add net tracked allocations; returns the pause (s) this triggers, usually 0."""
        if not self.enabled or objects <= 0:
            return 0.0
        self.room -= objects
        if self.room >= 0:
            return 0.0
        return self._collect() / 1e3

    @property
    def count0(self) -> int:
        """Net tracked allocations since the last collection."""
        return int(self.t0 - self.room) if self.enabled else 0

    def _collect(self) -> float:
        young = self.count0
        self.room = self.t0
        self.count1 += 1
        survivors = int(young * self.survive)
        if self.count1 <= self.t1:
            self.gen1_objects += survivors
            return self._pause(0, young)
        self.count1 = 0
        self.count2 += 1
        scanned = young + self.gen1_objects
        promoted = self.gen1_objects + survivors
        self.gen1_objects = 0
        self.pending += promoted
        if self.count2 > self.t2 and self.pending > self.long_lived // 4:
            self.count2 = 0
            self.long_lived += self.pending
            self.pending = 0
            return self._pause(2, scanned + self.long_lived)
        return self._pause(1, scanned)

    def _pause(self, generation: int, scanned: int) -> float:
        self.last_generation = generation
        self.num_collections[generation] += 1
        return self.pause_ms(generation, scanned)
