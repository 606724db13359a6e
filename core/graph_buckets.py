"""Token buckets of the mixed-step CUDA graphs (config key `cuda_graphs_mixed`): one rule, used
by the engine (engine.mixed_graphs captures a graph per bucket) and by the simulator's cost model
(sim.cost.model: a mixed step pays its bucket's padded tokens)."""

from __future__ import annotations

MIXED_GRAPH_POW2_MAX = 512  # mixed-graph buckets: powers of two up to here ...
MIXED_GRAPH_STEP = 256  # ... then every multiple of this


def mixed_graph_tokens(num_tokens: int) -> int:
    """The token bucket a mixed step's graph is captured for: the next power of two up to 512,
    then the next multiple of 256, so padding stays under 256 tokens where the GEMMs dominate."""
    if num_tokens <= MIXED_GRAPH_POW2_MAX:
        return 1 if num_tokens <= 1 else 1 << (num_tokens - 1).bit_length()
    return -(-num_tokens // MIXED_GRAPH_STEP) * MIXED_GRAPH_STEP


def mixed_graph_buckets(max_tokens: int) -> list[int]:
    """Every bucket a step of at most `max_tokens` tokens can land in, ascending (the last one
    is mixed_graph_tokens(max_tokens), which may exceed max_tokens)."""
    out = [1]
    while out[-1] < max_tokens:
        out.append(mixed_graph_tokens(out[-1] + 1))
    return out
