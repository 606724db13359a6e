"""Time of the tensor-parallel collectives of one GPU pass (docs/cost-model.md).

A Llama layer under Megatron-style tensor parallelism all-reduces its activations twice (after
the attention output projection and after the MLP down projection): 2 x num_layers all-reduces
of num_tokens x hidden_size x dtype bytes per pass. The vocab-parallel LM head all-gathers the
sampled rows' logits (rows x vocab_size x dtype bytes) so every rank samples the same tokens.

Ring algorithm model (NCCL's busbw convention): an all-reduce of S bytes over n GPUs moves
2 (n - 1) / n x S bytes through each GPU's link, an all-gather of S bytes in all (n - 1) / n x S:

  t = latency_ms + latency_ms_per_peer x (n - 1) + moved / (link bandwidth x bw_efficiency)

link bandwidth: bubblesim.core.gpus `link_gb_per_s` (one direction, NVLink 4: 450 GB/s). The three
parameters are the profile's `gpu_pass.allreduce`; `replay allreduce-fit` fits them from a
measured NCCL sweep (replay/gpu/nccl_sweep.py). With one GPU every collective costs 0.

One-shot all-reduce (config `tp_allreduce = "oneshot"`): a message the shared rule sends to it
(bubblesim.core.collectives.uses_oneshot: up to 2 MiB on 2 GPUs, 512 KiB on 4-8) is one kernel
in which every rank reads the n - 1 peers' copies and sums them:

  t = latency_ms + (n - 1) x S / (link bandwidth x bw_efficiency)

with the profile's `gpu_pass.allreduce_oneshot` parameters; larger messages take the ring. The
logits all-gather always takes NCCL's ring. `tp_allreduce = "fused"` (the all-reduce fused with
the residual add and RMSNorm, engine.kernels.reduce_norm: each rank pushes its copy to the
n - 1 peers) takes the same form with `gpu_pass.allreduce_fused`, on its own size rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bubblesim.core.collectives import oneshot_max_bytes, uses_oneshot
from bubblesim.core.gpus import GPUSpec
from bubblesim.core.models import DTYPE_BYTES, ModelSpec


def allreduce_moved_bytes(nbytes: float, n: int) -> float:
    """Bytes through each GPU's link for a ring all-reduce of `nbytes` over `n` GPUs."""
    return 2.0 * (n - 1) / n * nbytes


def allgather_moved_bytes(nbytes: float, n: int) -> float:
    """Bytes into each GPU for a ring all-gather whose result is `nbytes`."""
    return (n - 1) / n * nbytes


def oneshot_moved_bytes(nbytes: float, n: int) -> float:
    """Bytes each GPU reads over its link for a one-shot all-reduce of `nbytes` over `n` GPUs:
    the n - 1 peers' whole copies."""
    return (n - 1) * nbytes


@dataclass(frozen=True)
class OneshotPass:
    """The collectives of a pass whose all-reduces take the one-shot kernel: `model`, a linear
    model over BatchShape fields (sim.cost.linear), holds for passes whose all-reduce message
    is at most `max_tokens` tokens; larger ones take Collectives.pass_model (the ring)."""

    max_tokens: int
    model: dict[str, float]


class Collectives:
    """`Collectives(gpu, n, params, oneshot, algorithm)`: the all-reduce / all-gather cost on n
    GPUs of one host. `params`: gpu_pass.allreduce (the ring); `oneshot`: the one-kernel
    reduction's gpu_pass.allreduce_<algorithm> ("oneshot" or "fused"), for the messages that
    `algorithm` (config tp_allreduce) sends to it."""

    def __init__(
        self,
        gpu: GPUSpec,
        n: int,
        params: Mapping[str, Any],
        oneshot: Mapping[str, Any] | None = None,
        algorithm: str = "nccl",
    ):
        self.n = n
        self.gpu = gpu
        if n > 1 and gpu.link_gb_per_s <= 0:
            raise ValueError(f"GPU '{gpu.name}' has no link bandwidth for {n}-way collectives")
        bw = gpu.link_gb_per_s * 1e9 * float(params["bw_efficiency"])  # bytes/s
        self.ms_per_byte = 1e3 / bw if n > 1 else 0.0
        lat = float(params["latency_ms"]) + float(params["latency_ms_per_peer"]) * (n - 1)
        self.latency_ms = lat if n > 1 else 0.0
        # the one-shot kernel: none unless the algorithm and degree give it messages
        self.algorithm = algorithm
        self.oneshot_max_bytes = oneshot_max_bytes(algorithm, n)
        if self.oneshot_max_bytes and oneshot is None:
            raise ValueError(
                f"tp_allreduce '{algorithm}' needs the gpu_pass.allreduce_{algorithm} parameters"
            )
        self.oneshot_latency_ms = 0.0
        self.oneshot_ms_per_byte = 0.0
        if self.oneshot_max_bytes and oneshot is not None:
            self.oneshot_latency_ms = float(oneshot["latency_ms"])
            self.oneshot_ms_per_byte = 1e3 / (
                gpu.link_gb_per_s * 1e9 * float(oneshot["bw_efficiency"])
            )

    def allreduce_ms(self, nbytes: float) -> float:
        """An all-reduce of `nbytes`, by the algorithm the shared rule picks for it."""
        if self.n == 1:
            return 0.0
        if uses_oneshot(self.algorithm, int(nbytes), self.n):
            return self.oneshot_ms(nbytes)
        return self.latency_ms + allreduce_moved_bytes(nbytes, self.n) * self.ms_per_byte

    def oneshot_ms(self, nbytes: float) -> float:
        """A one-shot all-reduce of `nbytes` (whatever its size; allreduce_ms applies the rule)."""
        return (
            self.oneshot_latency_ms + oneshot_moved_bytes(nbytes, self.n) * self.oneshot_ms_per_byte
        )

    def allgather_ms(self, nbytes: float) -> float:
        if self.n == 1:
            return 0.0
        return self.latency_ms + allgather_moved_bytes(nbytes, self.n) * self.ms_per_byte

    def pass_model(self, model: ModelSpec, dtype: str) -> dict[str, float]:
        """A GPU pass's collectives with every all-reduce on the ring, as a linear model over
        BatchShape fields (sim.cost.linear): 2 x layers all-reduces of num_tokens x hidden, one
        all-gather of the sampled rows' logits (rows = decode_tokens + num_prefill_reqs).
        Empty with one GPU. With tp_allreduce "nccl" it is the pass's whole collective cost."""
        if self.n == 1:
            return {}
        dbytes = DTYPE_BYTES[dtype]
        calls = 2 * model.num_layers
        per_token = allreduce_moved_bytes(model.hidden_size * dbytes, self.n) * self.ms_per_byte
        per_row = allgather_moved_bytes(model.vocab_size * dbytes, self.n) * self.ms_per_byte
        return {
            "intercept": (calls + 1) * self.latency_ms,
            "num_tokens": calls * per_token,
            "decode_tokens": per_row,
            "num_prefill_reqs": per_row,
        }

    def oneshot_pass(self, model: ModelSpec, dtype: str) -> OneshotPass | None:
        """The pass's collectives when its all-reduces take the one-shot kernel (a message of
        at most max_tokens x hidden x dtype bytes, uses_oneshot's limit in tokens), the logits
        all-gather still the ring's; None when no message can (tp_allreduce "nccl", one GPU,
        or a single token's message over the limit)."""
        token_bytes = model.hidden_size * DTYPE_BYTES[dtype]
        max_tokens = self.oneshot_max_bytes // token_bytes
        if max_tokens < 1:
            return None
        calls = 2 * model.num_layers
        per_token = oneshot_moved_bytes(token_bytes, self.n) * self.oneshot_ms_per_byte
        per_row = (
            allgather_moved_bytes(model.vocab_size * DTYPE_BYTES[dtype], self.n) * self.ms_per_byte
        )
        return OneshotPass(
            max_tokens,
            {
                "intercept": calls * self.oneshot_latency_ms + self.latency_ms,
                "num_tokens": calls * per_token,
                "decode_tokens": per_row,
                "num_prefill_reqs": per_row,
            },
        )
