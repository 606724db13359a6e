"""Which all-reduce algorithm a tensor-parallel message takes: one rule shared by the engine
(engine.tp.comm) and the simulator (sim.cost.collective), so a predicted and a measured run
reduce the same messages the same way.

`tp_allreduce = "oneshot"`: a message of at most ONESHOT_MAX_BYTES[n] bytes over n GPUs is
reduced by one kernel in which every rank reads all n copies from the peers' symmetric-memory
buffers over NVLink and sums them ((n - 1) x S bytes read per rank, one cross-GPU barrier);
larger messages, and every message with "nccl", take NCCL's ring. The limits follow vLLM's
custom all-reduce (one-shot up to 8 MiB on 2 GPUs, 512 KiB beyond), where reading n - 1 full
copies stays cheaper than the ring's 2 (n - 1) / n x S in 2 (n - 1) latency-bound steps.
"""

from __future__ import annotations

ONESHOT_MAX_BYTES: dict[int, int] = {2: 8 << 20, 4: 512 << 10, 8: 512 << 10}


def oneshot_max_bytes(algorithm: str, n: int) -> int:
    """The largest message (bytes) that takes the one-shot kernel on n GPUs; 0 = none."""
    if algorithm != "oneshot" or n < 2:
        return 0
    return ONESHOT_MAX_BYTES.get(n, min(ONESHOT_MAX_BYTES.values()))


def uses_oneshot(algorithm: str, nbytes: int, n: int) -> bool:
    """Whether an all-reduce of `nbytes` over n GPUs takes the one-shot kernel."""
    return 0 < nbytes <= oneshot_max_bytes(algorithm, n)
