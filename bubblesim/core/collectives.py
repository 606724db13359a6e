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

`tp_allreduce = "fused"`: a message of at most FUSED_MAX_BYTES[n] bytes is reduced by one kernel
that also does the residual add and RMSNorm after the all-reduce (engine.kernels.reduce_norm):
each rank pushes its copy into the n - 1 peers' symmetric-memory buffers ((n - 1) x S bytes
written per rank, one cross-GPU barrier per row) and sums locally. Its limits are the one-shot
kernel's.
"""

from __future__ import annotations

ONESHOT_MAX_BYTES: dict[int, int] = {2: 2 << 20, 4: 512 << 10, 8: 512 << 10}
FUSED_MAX_BYTES = ONESHOT_MAX_BYTES
SMALL_MESSAGE_KERNELS = {"oneshot": ONESHOT_MAX_BYTES, "fused": FUSED_MAX_BYTES}


def oneshot_max_bytes(algorithm: str, n: int) -> int:
    """The largest message (bytes) that takes the algorithm's one-kernel reduction ("oneshot"
    or "fused") on n GPUs; 0 = none (NCCL's ring for every message)."""
    limits = SMALL_MESSAGE_KERNELS.get(algorithm)
    if limits is None or n < 2:
        return 0
    return limits.get(n, min(limits.values()))


def uses_oneshot(algorithm: str, nbytes: int, n: int) -> bool:
    """Whether an all-reduce of `nbytes` over n GPUs takes the algorithm's one-kernel
    reduction (one-shot or fused)."""
    return 0 < nbytes <= oneshot_max_bytes(algorithm, n)
