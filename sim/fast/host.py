"""What the fast path reads and moves of the step loop it runs inside (sim.loop.SimLoop): its
policy, recorder and models, its clock, its passes in flight and its arrivals. A protocol, so
the fast path names the loop's public face and never imports sim.loop (which imports it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from bubblesim.core.policy import Scheduler
from bubblesim.core.runfmt import RunRecorder
from sim.acceptance import AcceptanceModel
from sim.clock import Pass, StepClock
from sim.cost import CostModel
from sim.stepcosts import StepCosts


class Host(Protocol):
    sched: Scheduler
    rec: RunRecorder
    cost: CostModel
    costs: StepCosts
    accept: AcceptanceModel
    clock: StepClock
    inflight: deque[Pass]
    depth: int  # batches in flight at most
    wait_for_counts: bool  # prepare_inputs waits for the last step's accepted counts
    cpu_ngram: bool  # the CPU proposer: the draft phase waits for its own pass
    check: bool  # check the policy's invariants after every step
    peak_running: int  # most requests running at once
    tick_at_s: float  # the progress hook wants to look once the CPU clock gets here
    progress: Callable[[int], None] | None  # called with the last completed step

    def take_arrivals(self) -> float:
        """Submit the requests that arrived up to the CPU clock; returns `next_arrival_s()`."""

    def next_arrival_s(self) -> float:
        """When the next request arrives (inf when none is left)."""

    def draft_hints(self, entries: list[Any]) -> None:
        """The CPU proposer's draft counts for the next schedule of these entries' requests."""
