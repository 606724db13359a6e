"""Token buckets of the mixed-step CUDA graphs (config key `cuda_graphs_mixed`): one rule, used
by the engine (engine.mixed_graphs captures a graph per bucket) and by the simulator's cost model
(sim.cost.model: a mixed step pays its bucket's padded tokens)."""

from __future__ import annotations

from functools import cache

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


MIXED_GRAPH_FEW_ROWS = 16  # a bucket's graph variant for steps that sample at most this many


def mixed_graph_row_options(bucket: int, max_num_seqs: int) -> list[int]:
    """Logits/sampling row counts a bucket's graphs are captured for: all the sequences the
    bucket can hold (min(max_num_seqs, bucket)), and a variant of MIXED_GRAPH_FEW_ROWS rows
    for steps that sample few tokens (prefill-heavy steps), whose padded logits rows would
    otherwise cost the lm-head GEMM and sampling of up to max_num_seqs rows."""
    rows = min(max_num_seqs, bucket)
    return sorted({min(rows, MIXED_GRAPH_FEW_ROWS), rows})


def mixed_graph_rows(num_gen: int, bucket: int, max_num_seqs: int) -> int:
    """The sampling rows of the graph a step of `bucket` tokens sampling num_gen tokens runs."""
    return next(r for r in mixed_graph_row_options(bucket, max_num_seqs) if r >= num_gen)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ..., 64 (step 8), 80, ..., 128 (step 16), 160, ... (step 32), then
    max_num_seqs itself, all <= max_num_seqs."""
    out = [1, 2, 4]
    b, step = 8, 8
    while b < max_num_seqs:
        out.append(b)
        if b >= 128:
            step = 32
        elif b >= 64:
            step = 16
        b += step
    out.append(max_num_seqs)
    return sorted({x for x in out if x <= max_num_seqs})


def decode_graph_rows(num_reqs: int, max_num_seqs: int, max_tokens: int, query_len: int = 1) -> int:
    """The rows of the decode graph a pure decode of `num_reqs` requests replays (engine.graphs:
    buckets for min(max_num_seqs, max_tokens // query_len) rows), or num_reqs when none holds
    it (eager)."""
    return _graph_rows(num_reqs, min(max_num_seqs, max_tokens // query_len))


@cache
def _graph_rows(num_reqs: int, max_rows: int) -> int:
    """decode_graph_rows, kept per (batch, graph cap): the simulator asks at every step."""
    return next((b for b in decode_buckets(max_rows) if b >= num_reqs), num_reqs)
