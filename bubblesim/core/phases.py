"""Names shared by the engine's step loop, the simulator's model of it and the run format.

One engine step on the CPU thread runs these phases in this order (some may be absent):
schedule -> prepare_inputs -> launch -> sample -> draft -> process_outputs.
`sync` is time the CPU thread blocks on the GPU (a D2H copy or an event), `gc` a collector pause.
"""

from __future__ import annotations

SCHEDULE = "schedule"  # policy: pick requests and token counts, allocate KV blocks
PREPARE_INPUTS = "prepare_inputs"  # build input ids, positions, slot mapping, block tables (H2D)
LAUNCH = "launch"  # issue the forward pass (eager kernels or a CUDA graph replay)
SAMPLE = "sample"  # launch sampling / rejection (incl. the placeholder scan of seed 3)
DRAFT = "draft"  # propose draft tokens (n-gram on CPU or GPU)
PROCESS_OUTPUTS = "process_outputs"  # apply results: append tokens, finish requests, free blocks
# tensor parallelism: rank 0 sends a step's inputs to the other ranks (between prepare_inputs
# and launch; absent with tensor_parallel_size 1). Not one of CPU_PHASES (the run format's
# columns, the hooks' arrays and the sim's fast paths are laid out by that tuple): its time is
# part of `launch`, which it precedes (sim.cost term `launch.tp_broadcast`)
BROADCAST = "broadcast"
SYNC = "sync"  # CPU blocked waiting for the GPU
GC = "gc"  # Python garbage-collector pause

CPU_PHASES: tuple[str, ...] = (SCHEDULE, PREPARE_INPUTS, LAUNCH, SAMPLE, DRAFT, PROCESS_OUTPUTS)
ALL_CPU_ACTIVITIES: tuple[str, ...] = (*CPU_PHASES, SYNC, GC)

# Bubble causes: a CPU activity name, or one of these.
CAUSE_LAUNCH_GAP = "launch_gap"  # GPU idle with the CPU thread in no recorded activity
