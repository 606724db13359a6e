"""`mixed_keys` and `grid_blocks`: derived terms of a mixed step's attention (a step with a
prefill chunk), from this engine's paged attention kernel (engine/kernels/paged_attention.py,
per-sequence grid: the eager mixed step).

The kernel's grid is (sequence, kv head, query block x split); a program walks the keys of one
block of BLOCK_Q query tokens of one sequence (BLOCK_M = BLOCK_Q x GROUP rows: 64, or 16 when
max_query_len x GROUP <= 16). So, besides the total work (attn_pairs, kv_read_tokens):
- `mixed_keys`: keys the longest program walks. A chunk's last query block walks its whole
  context; a one-token (decode) row beside a chunk of more than 16 tokens is cut into at most
  MAX_LONG_SPLITS runs of at least LONG_SPLIT_KEYS keys (`choose_decode_splits`); with
  max_query_len <= 16 every row's keys split alike (`choose_num_splits`). A chunk of 64 tokens
  after 131k of context runs 32 programs on 132 SMs: the step costs what the one program walks
  (56 ms on an H100, like a 256-token chunk's 128 programs), not attn_pairs' share.
- `grid_blocks`: programs per kv head, num_seqs x max(query blocks x splits, decode splits):
  every sequence gets the longest chunk's query blocks, and those of a one-token row exit at
  once. 255 decode rows beside a 7937-token chunk launch 1M programs a layer (+14 ms, +24 %).
A BatchShape has no per-request lengths, so the chunk's length is prefill_tokens /
num_prefill_reqs (exact for one chunk or equal chunks) and its context is solved from
attn_pairs and kv_read_tokens (a chunk of q tokens after context C adds q x C - q (q - 1) / 2
pairs and C keys; a decode row adds its context to both), clamped to [q, max_kv_tokens].
The grid's query blocks follow the LONGEST chunk (the kernel sizes axis 2 by max_query_len),
which with unequal chunks is well above the mean: `longest_chunk` estimates it as the
token-weighted mean chunk length, sum q_i^2 / sum q_i = 2 (attn_pairs - kv_read_tokens) /
prefill_tokens + 1 for fresh chunks (a decode row adds as many pairs as keys; a verify row's
drafts add k x its context, taken out at the decode rows' mean context), exact for equal
chunks, clamped to [the mean chunk, the most one chunk can hold]. On llama3.2-1b's 1b-asap2
check (2-5 chunks of 8k tokens beside up to 180 decode rows) the mean chunk's grid left the
clean mixed steps 5.5 % above the profile (1.017 with this estimate and the uneven-chunk
sweep: reports/fidelity/README.md section E).
Both functions read every field they use on every call (the fast-forward's probe,
sim/stepcosts.py, sees which fields a cost reads). Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TARGET_PROGRAMS_PER_SM = 2  # paged_attention.choose_num_splits
MIN_KEYS_PER_SPLIT = 256  # paged_attention._MIN_KEYS_PER_SPLIT
MAX_SPLITS = 16  # paged_attention._MAX_SPLITS
MAX_SPLIT_QUERY = 16  # splits only for max_query_len <= this
LONG_SPLIT_KEYS = 4096  # decode_attention.LONG_SPLIT_KEYS (choose_decode_splits, min_tiles)
MAX_LONG_SPLITS = 8  # decode_attention.MAX_LONG_SPLITS
BLOCK_M, SMALL_BLOCK_M = 64, 16

MIXED_KEYS = "mixed_keys"
GRID_BLOCKS = "grid_blocks"
MIXED_DERIVED = (MIXED_KEYS, GRID_BLOCKS)
# a profile's rule for the grid's query blocks (sim.cost.profile MIXED_GRID_KEY): its mixed
# fits hold coefficients of the derived terms as that rule computed them
GRID_RULES = ("mean", "longest")

ShapeFn = Callable[[Any], float]


def _pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _cdiv(a: float, b: int) -> int:
    return -(-int(a) // b)


def longest_chunk(reqs: int, chunks: int, pre: int, drafts: int, kv: int, pairs: int) -> int:
    """The longest prefill chunk's query tokens, estimated from a shape (module docstring):
    exact for one chunk and for equal fresh chunks; the token-weighted mean chunk otherwise."""
    mean = _cdiv(pre, chunks)
    if chunks <= 1:
        return mean
    extra = float(pairs - kv)  # sum over chunks of (q - 1)(C + q / 2) (+ drafts x context)
    if drafts > 0 and reqs > chunks:  # drafts at the decode rows' mean context (an upper bound)
        extra -= drafts * max(kv - pre, 0) / (reqs - chunks)
    weighted = int(2 * extra / pre + 1)  # sum q^2 / sum q for fresh chunks
    return min(max(weighted, mean), pre - (chunks - 1))


def mixed_attention_fn(
    num_q_heads: int, num_kv_heads: int, sms: int, flat: bool = False, by_longest: bool = True
) -> Callable[[Any], tuple[float, float]]:
    """`shape -> (mixed_keys, grid_blocks)` for a model and a GPU; (0, 0) without a chunk.
    `by_longest`: the grid's query blocks from `longest_chunk` (the kernel's); False: from the mean
    chunk, the rule of profiles fitted before it (MIXED_GRID_KEY: "mean").
    `flat`: the flat grid of a mixed-step CUDA graph (engine.mixed_graphs), whose blocks are
    num_tokens // BLOCK_Q + num_seqs (+ decode splits past the first per sequence): no
    sequence gets another's query blocks (the graph's padding is its bucket's, priced apart)."""
    group = max(num_q_heads // max(num_kv_heads, 1), 1)
    fill = TARGET_PROGRAMS_PER_SM * sms

    def attention(s: Any) -> tuple[float, float]:
        reqs, chunks, pre = s.num_reqs, s.num_prefill_reqs, s.prefill_tokens
        dec_tok, drafts = s.decode_tokens, s.draft_tokens
        kv, pairs, longest = s.kv_read_tokens, s.attn_pairs, s.max_kv_tokens
        if chunks <= 0 or pre <= 0:
            return 0.0, 0.0
        tokens = pre + dec_tok
        q = _cdiv(pre, chunks)  # the mean chunk: its context solve below takes chunks alike
        # max_query_len's estimate (the mean chunk under the old rule)
        q_max = longest_chunk(reqs, chunks, pre, drafts, kv, pairs) if by_longest else q
        block_m = max(BLOCK_M if q_max * group > 16 else SMALL_BLOCK_M, _pow2(group))
        block_q = max(block_m // group, 1)
        blocks = _cdiv(q_max, block_q)
        if q_max <= MAX_SPLIT_QUERY:  # every row splits alike (choose_num_splits)
            programs = reqs * blocks * num_kv_heads
            splits = 1
            if programs < fill:
                splits = min(_cdiv(fill, programs), _cdiv(longest, MIN_KEYS_PER_SPLIT), MAX_SPLITS)
                splits = _pow2(splits)
            if flat:
                return float(_cdiv(longest, splits)), float(tokens // block_q + reqs)
            return float(_cdiv(longest, splits)), float(reqs * blocks * splits)
        ctx = ((pairs - kv) / (q - 1) + chunks * q / 2) / chunks
        ctx = min(max(ctx, float(q)), float(longest))
        dec = _pow2(min(_cdiv(longest, LONG_SPLIT_KEYS), MAX_LONG_SPLITS))
        row = min(longest, max(_cdiv(longest, dec), LONG_SPLIT_KEYS)) if reqs > chunks else 0
        if flat:
            return float(max(ctx, row)), float(tokens // block_q + reqs * dec)
        return float(max(ctx, row)), float(reqs * max(blocks, dec))

    return attention


def mixed_derived(
    num_q_heads: int, num_kv_heads: int, sms: int, flat: bool = False, by_longest: bool = True
) -> dict[str, ShapeFn]:
    """The two derived terms as functions of a shape (sim.cost.linear's `derived`); `by_longest`
    as mixed_attention_fn's."""
    fn = mixed_attention_fn(num_q_heads, num_kv_heads, sms, flat, by_longest)
    return {MIXED_KEYS: lambda s: fn(s)[0], GRID_BLOCKS: lambda s: fn(s)[1]}
