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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bubblesim.core.gpus import GPUSpec
from bubblesim.core.models import DTYPE_BYTES, ModelSpec


def allreduce_moved_bytes(nbytes: float, n: int) -> float:
    """Bytes through each GPU's link for a ring all-reduce of `nbytes` over `n` GPUs."""
    return 2.0 * (n - 1) / n * nbytes


def allgather_moved_bytes(nbytes: float, n: int) -> float:
    """Bytes into each GPU for a ring all-gather whose result is `nbytes`."""
    return (n - 1) / n * nbytes


class Collectives:
    """`Collectives(gpu, n, params)`: the all-reduce / all-gather cost on n GPUs of one host."""

    def __init__(self, gpu: GPUSpec, n: int, params: Mapping[str, Any]):
        self.n = n
        self.gpu = gpu
        if n > 1 and gpu.link_gb_per_s <= 0:
            raise ValueError(f"GPU '{gpu.name}' has no link bandwidth for {n}-way collectives")
        bw = gpu.link_gb_per_s * 1e9 * float(params["bw_efficiency"])  # bytes/s
        self.ms_per_byte = 1e3 / bw if n > 1 else 0.0
        lat = float(params["latency_ms"]) + float(params["latency_ms_per_peer"]) * (n - 1)
        self.latency_ms = lat if n > 1 else 0.0

    def allreduce_ms(self, nbytes: float) -> float:
        if self.n == 1:
            return 0.0
        return self.latency_ms + allreduce_moved_bytes(nbytes, self.n) * self.ms_per_byte

    def allgather_ms(self, nbytes: float) -> float:
        if self.n == 1:
            return 0.0
        return self.latency_ms + allgather_moved_bytes(nbytes, self.n) * self.ms_per_byte

    def pass_model(self, model: ModelSpec, dtype: str) -> dict[str, float]:
        """A GPU pass's collectives as a linear model over BatchShape fields (sim.cost.linear):
        2 x layers all-reduces of num_tokens x hidden, one all-gather of the sampled rows'
        logits (rows = decode_tokens + num_prefill_reqs). Empty with one GPU."""
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
