"""How many KV blocks a config gets, and the scheduler config derived from a Config."""

from __future__ import annotations

from bubblesim.core.config import Config
from bubblesim.core.models import DTYPE_BYTES, ModelSpec
from bubblesim.core.policy.scheduler import SchedulerConfig

# Memory a serving engine keeps outside weights and KV: activations, CUDA graph pools, the
# sampler's logits buffers, allocator slack. 1.5 GiB is in line with what vLLM profiles for 8B
# models at default batch limits; replay sizes the real engine from measured free memory.
ACTIVATION_RESERVE_BYTES = int(1.5 * 2**30)


def kv_blocks_from_free_bytes(cfg: Config, model: ModelSpec, free_bytes: float) -> int:
    """Blocks that fit in `free_bytes` x kv_memory_fraction (free = after weights), on one GPU:
    with tensor parallelism a block holds that rank's KV heads of block_size tokens, and every
    rank holds the same blocks."""
    per_block = model.kv_bytes_per_token(cfg.dtype, cfg.tensor_parallel_size) * cfg.block_size
    return max(0, int(free_bytes * cfg.kv_memory_fraction) // per_block)


def kv_blocks_for_gpu(cfg: Config, model: ModelSpec, gpu_memory_bytes: float) -> int:
    """The sim's KV budget: one GPU's memory less its weights (its shard under tensor
    parallelism) and an activation reserve."""
    if cfg.num_kv_blocks > 0:
        return cfg.num_kv_blocks
    weights = model.weight_bytes(cfg.dtype, cfg.tensor_parallel_size)
    free = gpu_memory_bytes - weights - ACTIVATION_RESERVE_BYTES
    return kv_blocks_from_free_bytes(cfg, model, free)


def scheduler_config(cfg: Config, model: ModelSpec, num_blocks: int) -> SchedulerConfig:
    max_len = cfg.max_model_len or model.max_context
    return SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        num_blocks=num_blocks,
        block_size=cfg.block_size,
        max_model_len=max_len,
        chunked_prefill=cfg.chunked_prefill,
        prefix_caching=cfg.prefix_caching,
        spec_k=cfg.spec.k if cfg.spec.enabled else 0,
    )


__all__ = ["DTYPE_BYTES", "kv_blocks_for_gpu", "kv_blocks_from_free_bytes", "scheduler_config"]
