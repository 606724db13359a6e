"""Paged attention over a mixed batch (prefill chunks, decodes, k+1 verification) in one launch.

Sequence b owns query tokens query_start_loc[b] .. query_start_loc[b+1] (q_b of them) and has
seq_lens[b] tokens of context including those new ones, whose K/V are already in the cache.
Query i of sequence b sits at position p = seq_lens[b] - q_b + i and attends keys 0..p (causal).
Key j of sequence b lives in slot block_tables[b, j // block_size] * block_size + j % block_size.

Grid: (sequence, kv head, query block x KV split). A program takes BLOCK_Q query tokens of one
sequence times the GROUP query heads that share one kv head (BLOCK_M = BLOCK_Q * GROUP rows, padded
to a power of two), so each K/V tile is read once per kv head and used by all its query heads:
a decode batch streams the cache at close to memory bandwidth. Online softmax in fp32 (base 2).

Split-KV (flash decoding): with few programs and long contexts, the key range of each query block
is cut into NUM_SPLITS pieces run by separate programs; each writes an unnormalised partial
(acc, running max, running sum) and `_reduce_splits_kernel` merges them.

Decode splits (mixed batches, max_query_len > 16, where NUM_SPLITS is 1): a sequence with one
query token beside prefill chunks would otherwise walk its whole context in one program per kv
head (a 38k-token decode row: ~600 tiles per layer, the step's straggler). With DECODE_SPLITS > 1
such a row's keys are cut into at most DECODE_SPLITS runs of at least `min_tiles` tiles (long
contexts only, as in engine.kernels.decode_attention); grid axis 2 is the query block for
prefill rows and the split for one-token rows. Their partials are indexed by sequence
([DECODE_SPLITS, B, Hq, ...]: small whatever the token count) and merged by the same reduce
kernel run per sequence (BY_SEQ); rows with more query tokens write their output directly.

All sizes come from tensors or constexprs: the host reads no tensor values, so a CUDA graph
captured with a (batch, max_query_len, max_seq_len) bucket replays with new data in the same
buffers. Output rows of tokens past query_start_loc[B] (graph padding) are left undefined.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from engine.kernels.decode_attention import LONG_SPLIT_KEYS, MAX_LONG_SPLITS

_LOG2E = 1.4426950408889634
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 16


@triton.jit(do_not_specialize=["num_seqs", "min_tiles"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,  # fp32 [NUM_SPLITS, T, Hq, HEAD_DIM] or [DECODE_SPLITS, B, Hq, HEAD_DIM]
    part_ml_ptr,  # fp32 [.., 2] (running max in log2 units, running sum); only with splits
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,  # softmax scale * log2(e)
    num_tokens,
    num_seqs,
    min_tiles,  # tiles a decode split takes at least (DECODE_SPLITS > 1)
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_bt,
    stride_cache_block,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE_SPLITS: tl.constexpr,  # > 1 only with NUM_SPLITS == 1
    FLAT_SEQS: tl.constexpr,  # 0: axis 0 is the sequence; else a power of two >= num_seqs
):
    if FLAT_SEQS > 0:  # axis 1: a block of the flat layout, axis 0 the kv head (`paged_attention`)
        pid = tl.program_id(1)
        kv_head = tl.program_id(0)
        seq, q_block = _flat_query_block(pid, query_start_loc_ptr, num_seqs, BLOCK_Q, FLAT_SEQS)
        split = tl.program_id(2)  # NUM_SPLITS (1 with DECODE_SPLITS > 1)
        if DECODE_SPLITS > 1:  # past the flat blocks: splits 1.. of each sequence row
            extra = pid - (num_tokens // BLOCK_Q + num_seqs)
            seq = tl.where(extra >= 0, extra // (DECODE_SPLITS - 1), seq)
            q_block = tl.where(extra >= 0, 0, q_block)
            split = tl.where(extra >= 0, extra % (DECODE_SPLITS - 1) + 1, 0)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if FLAT_SEQS > 0:
        if DECODE_SPLITS > 1:  # only one-token rows have splits past 0
            is_decode = q_len == 1
            if (split > 0) & (q_len != 1):
                return
    elif DECODE_SPLITS > 1:  # axis 2: the split of a one-token row, else the query block
        is_decode = q_len == 1
        q_block = tl.where(is_decode, 0, tl.program_id(2))
        split = tl.where(is_decode, tl.program_id(2), 0)
        if split >= DECODE_SPLITS:
            return
    else:
        q_block = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys before the first new token

    # Keys this query block needs: 0 .. its last row's position; this split's share of tiles.
    num_keys = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(num_keys, BLOCK_N)
    if DECODE_SPLITS > 1:  # one-token rows: runs of >= min_tiles; others: every tile
        tiles_per_split = tl.where(
            is_decode, tl.maximum(tl.cdiv(num_tiles, DECODE_SPLITS), min_tiles), num_tiles
        )
        num_active = tl.cdiv(num_tiles, tiles_per_split)  # 1 unless a long one-token row
        if split >= num_active:
            return  # no tiles: nothing to write (the reduce skips inactive splits)
    else:
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    # Row r of the tile: query token q_block * BLOCK_Q + r // GROUP, query head of this kv group.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    pos = context_len + q_idx  # each row attends keys 0..pos
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # A finite initial max keeps fully masked rows NaN-free (their exp2 terms are exactly 0).
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < num_keys
        block = tl.load(block_table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_row = block * stride_cache_block + (keys % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
        kv_row += kv_head * HEAD_DIM
        kv_mask = key_ok[None, :] & dim_ok[:, None]
        k_t = tl.load(k_cache_ptr + kv_row[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, k_t) * scale_log2  # [BLOCK_M, BLOCK_N] fp32
        s = tl.where((keys[None, :] <= pos[:, None]) & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + kv_row[:, None] + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # NUM_SPLITS: every split writes its partial, an empty one too (l = 0: weight 0 in the
    # merge). DECODE_SPLITS: only active splits run; a row with one active split is finished.
    if NUM_SPLITS > 1:
        part_row = (split * num_tokens + token) * NUM_Q_HEADS + head  # int64
        _store_partial(part_acc_ptr, part_ml_ptr, part_row, acc, m_i, l_i, dims, row_ok, dim_ok,
                       HEAD_DIM)  # fmt: skip
    elif DECODE_SPLITS > 1:
        if num_active > 1:
            part_row = (split * num_seqs + seq).to(tl.int64) * NUM_Q_HEADS + head
            _store_partial(part_acc_ptr, part_ml_ptr, part_row, acc, m_i, l_i, dims, row_ok,
                           dim_ok, HEAD_DIM)  # fmt: skip
        else:
            _store_out(out_ptr, acc, l_i, token, head, dims, row_ok, dim_ok, stride_o_t,
                       stride_o_h)  # fmt: skip
    else:
        _store_out(out_ptr, acc, l_i, token, head, dims, row_ok, dim_ok, stride_o_t, stride_o_h)


@triton.jit
def _flat_query_block(pid, query_start_loc_ptr, num_seqs, BLOCK_Q: tl.constexpr,
                      FLAT_SEQS: tl.constexpr):  # fmt: skip
    """(sequence, query block) of flat block `pid`: sequence s owns the flat blocks
    first[s] .. first[s + 1] - 1, first[s] = query_start_loc[s] // BLOCK_Q + s (strictly
    increasing, and at least cdiv(q_s, BLOCK_Q) ids each). One vector load, no search loop."""
    s = tl.arange(0, FLAT_SEQS)
    real = s < num_seqs
    first = tl.load(query_start_loc_ptr + s, mask=real, other=0) // BLOCK_Q + s
    seq = tl.sum(((first <= pid) & real).to(tl.int32), 0) - 1
    return seq, pid - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)


@triton.jit
def _store_out(out_ptr, acc, l_i, token, head, dims, row_ok, dim_ok, stride_o_t, stride_o_h):
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _store_partial(part_acc_ptr, part_ml_ptr, part_row, acc, m_i, l_i, dims, row_ok, dim_ok,
                   HEAD_DIM: tl.constexpr):  # fmt: skip
    tl.store(
        part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :],
        acc,
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_ok)
    tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["min_tiles"])
def _reduce_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    num_seqs,
    num_tokens,
    min_tiles,
    stride_o_t,
    stride_o_h,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BY_SEQ: tl.constexpr,  # program 0 axis: a sequence (decode splits), else a token
):
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    if BY_SEQ:  # one-token rows with > 1 active split (the attention kernel's rule) merge
        seq = tl.program_id(0)
        token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
        if tl.load(query_start_loc_ptr + seq + 1) - token != 1:
            return
        num_tiles = tl.cdiv(tl.load(seq_lens_ptr + seq), BLOCK_N)
        num_active = tl.cdiv(num_tiles, tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), min_tiles))
        if num_active == 1:
            return  # the attention kernel wrote this row's output
        part_row = (splits * num_seqs + seq).to(tl.int64) * NUM_Q_HEADS + head
        active = splits < num_active
    else:
        token = tl.program_id(0).to(tl.int64)
        if token >= tl.load(query_start_loc_ptr + num_seqs):
            return  # graph padding: no partials were written
        part_row = (splits * num_tokens + token) * NUM_Q_HEADS + head
        active = splits < NUM_SPLITS
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    m = tl.load(part_ml_ptr + part_row * 2, mask=active, other=float("-inf"))
    l = tl.load(part_ml_ptr + part_row * 2 + 1, mask=active, other=0.0)
    acc = tl.load(
        part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :],
        mask=active[:, None] & dim_ok[None, :],
        other=0.0,
    )
    weight = tl.exp2(m - tl.max(m, 0))  # empty and inactive splits: l = 0, acc = 0
    total = tl.sum(weight * l, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    num_programs: int, max_query_len: int, max_seq_len: int, device: torch.device
) -> int:
    """KV splits so that few long sequences still fill the GPU (a power of two, 1 = no split).

    Host-side integers only; any choice is correct, it only changes speed."""
    if device.type != "cuda" or max_query_len > 16:
        return 1
    target_programs = 2 * _num_sms(device.index or 0)
    if num_programs >= target_programs:
        return 1
    splits = min(
        math.ceil(target_programs / num_programs),
        math.ceil(max_seq_len / _MIN_KEYS_PER_SPLIT),
        _MAX_SPLITS,
    )
    return 1 if splits <= 1 else triton.next_power_of_2(splits)


def choose_decode_splits(max_query_len: int, max_seq_len: int, device: torch.device) -> int:
    """Splits for the one-token rows of a mixed batch (max_query_len > 16): only long contexts,
    up to MAX_LONG_SPLITS runs of LONG_SPLIT_KEYS keys, as the decode kernel does in large
    batches (a power of two, 1 = none). Host-side integers only."""
    if device.type != "cuda" or max_query_len <= 16:
        return 1
    splits = min(math.ceil(max_seq_len / LONG_SPLIT_KEYS), MAX_LONG_SPLITS)
    return 1 if splits <= 1 else triton.next_power_of_2(splits)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D], head_dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # int32 [B+1]
    seq_lens: torch.Tensor,  # int32 [B]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    max_query_len: int,  # >= every q_b (a bucket bound is fine)
    max_seq_len: int,  # >= every seq_lens[b]; only steers the split choice
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    num_splits: int = 0,  # 0 = choose; else a power of two
    block_m: int = 0,  # tile rows (query tokens x group heads), a power of two >= 16; 0 = choose
    block_n: int = 0,  # keys per tile, a power of two >= 16; 0 = choose
    decode_splits: int = 0,  # one-token rows' splits when num_splits is 1; 0 = choose
    min_tiles: int = 0,  # tiles a decode split takes at least; 0 = LONG_SPLIT_KEYS' worth
    flat: bool = False,  # the flat grid (a static grid for a token bucket, see below)
) -> torch.Tensor:
    """Attention of every query token (module docstring). Grid axis 0 is the sequence and
    axis 2 the query block x split, sized by max_query_len: right for a batch whose bounds are
    its own. `flat`: axis 1 runs over num_tokens // BLOCK_Q + num_seqs query blocks of all the
    sequences at once (a sequence's blocks start at query_start_loc[s] // BLOCK_Q + s; axis 0
    is the kv head), so the grid depends on the token count and the number of sequence rows
    only: a mixed-step CUDA graph of a token bucket (engine.mixed_graphs) captures it with
    num_seqs = the most
    sequences the bucket can hold and max_query_len = its tokens, and programs past the real
    work (padded rows own no query tokens) exit at once; decode splits 1.. of each row (only
    one-token rows use them) come after the flat blocks. With the per-sequence grid such a
    bucket would launch num_seqs x cdiv(tokens, BLOCK_Q) programs per kv head, almost all
    empty (256 x 128 for 2048 tokens)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert cache_dim == head_dim and num_q_heads % num_kv_heads == 0, "q does not match cache"
    assert k_cache.stride()[1:] == (num_kv_heads * head_dim, head_dim, 1), "cache rows"
    assert v_cache.stride() == k_cache.stride(), "k and v caches must share strides"
    assert q.stride(2) == 1 and block_tables.stride(1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    rows = max_query_len * group
    block_m = max(block_m or (64 if rows > 16 else 16), triton.next_power_of_2(group))
    block_q = block_m // group
    block_n = block_n or (64 if head_dim <= 128 else 32)
    num_q_blocks = triton.cdiv(max(max_query_len, 1), block_q)
    flat_blocks = num_tokens // block_q + num_seqs  # axis 0 of the flat grid
    if num_splits <= 0:
        blocks = flat_blocks if flat else num_seqs * num_q_blocks
        num_splits = choose_num_splits(blocks * num_kv_heads, max_query_len, max_seq_len, q.device)
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    if num_splits > 1:
        decode_splits = 1
    elif decode_splits <= 0:
        decode_splits = choose_decode_splits(max_query_len, max_seq_len, q.device)
    assert decode_splits & (decode_splits - 1) == 0, "decode_splits must be a power of two"
    min_tiles = min_tiles or max(1, LONG_SPLIT_KEYS // block_n)

    # partial rows: per token with NUM_SPLITS, per sequence with DECODE_SPLITS
    split_rows = num_splits * num_tokens if num_splits > 1 else decode_splits * num_seqs
    if num_splits > 1 or decode_splits > 1:
        part_acc = torch.empty(
            (split_rows, num_q_heads, head_dim), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty((split_rows, num_q_heads, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    dim_pad = triton.next_power_of_2(head_dim)
    if flat:  # decode splits 1.. of every sequence row follow the flat blocks on axis 1;
        # the kv heads of one query block run side by side (axis 0), as in the other grid:
        # they read the same cache rows (~10 % faster than blocks side by side on an H100)
        blocks = flat_blocks + num_seqs * (decode_splits - 1)
        assert blocks < 65536, "flat grid: too many query blocks for grid axis 1"
        grid = (num_kv_heads, blocks, num_splits)
    elif decode_splits == 1:
        grid = (num_seqs, num_kv_heads, num_q_blocks * num_splits)
    else:
        grid = (num_seqs, num_kv_heads, max(num_q_blocks, decode_splits))
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_ml,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        num_tokens,
        num_seqs,
        min_tiles,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        DECODE_SPLITS=decode_splits,
        FLAT_SEQS=triton.next_power_of_2(num_seqs) if flat else 0,
        num_warps=8 if block_m >= 64 else 4,  # sm_90: no register spills either way
    )
    if num_splits > 1 or decode_splits > 1:
        by_seq = decode_splits > 1
        _reduce_splits_kernel[(num_seqs if by_seq else num_tokens, num_q_heads)](
            part_acc,
            part_ml,
            out,
            query_start_loc,
            seq_lens,
            num_seqs,
            num_tokens,
            min_tiles,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            NUM_SPLITS=max(num_splits, decode_splits),
            BLOCK_N=block_n,
            BY_SEQ=by_seq,
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out
