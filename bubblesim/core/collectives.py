"""Which all-reduce algorithm a tensor-parallel message takes: one rule shared by the engine
(engine.tp.comm) and the simulator (sim.cost.collective), so a predicted and a measured run
reduce the same messages the same way.

`tp_allreduce = "oneshot"`: a message of at most ONESHOT_MAX_BYTES[n] bytes over n GPUs is
reduced by one kernel in which every rank reads all n copies from the peers' symmetric-memory
buffers over NVLink and sums them ((n - 1) x S bytes read per rank, one cross-GPU barrier);
larger messages, and every message with "nccl", take NCCL's ring. The limits are where the
one-shot kernel stopped beating NCCL's graph-captured ring on the lent H100s
(reports/tp/README.md, `replay allreduce`, 2026-11-26): on 2 GPUs 8.6-10 us vs 10.4-12.4 us up
to 128 KiB, 25.1 vs 32.7 us at 2 MiB, but 40.5 vs 37.0 at 4 MiB; on 4 GPUs 9.6-12 vs 16-19 us
up to 128 KiB and 17.4 vs 21.5 us at 512 KiB (the largest size tried; vLLM's custom all-reduce
also stops one-shot at 512 KiB beyond 2 GPUs). 8 GPUs: vLLM's limit, not measured here.
"""

from __future__ import annotations

ONESHOT_MAX_BYTES: dict[int, int] = {2: 2 << 20, 4: 512 << 10, 8: 512 << 10}


def oneshot_max_bytes(algorithm: str, n: int) -> int:
    """The largest message (bytes) that takes the one-shot kernel on n GPUs; 0 = none."""
    if algorithm != "oneshot" or n < 2:
        return 0
    return ONESHOT_MAX_BYTES.get(n, min(ONESHOT_MAX_BYTES.values()))


def uses_oneshot(algorithm: str, nbytes: int, n: int) -> bool:
    """Whether an all-reduce of `nbytes` over n GPUs takes the one-shot kernel."""
    return 0 < nbytes <= oneshot_max_bytes(algorithm, n)
