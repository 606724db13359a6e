"""The fast path: what the step loop (sim.loop) would do, step for step, in fewer Python
operations, with the same result to the bit (tests/test_sim_fastforward.py).

- `FastForward` (decode.py): runs of plain decode steps in bulk;
- `SpecForward` (spec.py): runs of speculative verify steps in one loop;
- `SpecSteps` (specstep.py): single speculative steps, fused.

Each runs the policy's public primitives (bubblesim.core.policy.Scheduler) on the real requests, and
every step's timing through the one phase block, sim.clock.StepClock, that the step loop runs.
"""

from sim.fast.decode import FastForward
from sim.fast.spec import SpecForward
from sim.fast.specstep import SpecSteps

__all__ = ["FastForward", "SpecForward", "SpecSteps"]
