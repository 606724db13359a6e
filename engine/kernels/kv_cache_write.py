"""Write the new tokens' K and V into the paged cache through `slot_mapping`.

Cache layout (one layer, K and V alike): [num_blocks, block_size, num_kv_heads, head_dim]; the
slot of a token is block_id * block_size + offset, so the slot's row starts at
slot * num_kv_heads * head_dim when the last three dims are contiguous (the block dim may have any
stride, e.g. a view into the engine's [layers, 2, blocks, ...] tensor). Slot < 0 = skip (padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_cache_block,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    row = block * stride_cache_block + (slot % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = row + h * HEAD_DIM + d
    k = tl.load(k_ptr + token * stride_k_t + h * stride_k_h + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_v_t + h * stride_v_h + d, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    v: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int32/int64 [T]; < 0 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    _, block_size, cache_heads, cache_dim = k_cache.shape
    assert (cache_heads, cache_dim) == (num_kv_heads, head_dim), "k/v do not match the cache"
    assert k_cache.stride()[1:] == (num_kv_heads * head_dim, head_dim, 1), "cache rows"
    assert v_cache.stride() == k_cache.stride(), "k and v caches must share strides"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v head_dim must be contiguous"
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,  # [T, Hq, D] view, rotated in place
    k_ptr,  # [T, Hkv, D] view, read only
    v_ptr,
    positions_ptr,
    cos_ptr,  # fp32 [max_positions, D // 2]
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_cs,
    stride_cache_block,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    cos = tl.load(cos_ptr + pos * stride_cs + d, mask=d_ok)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cs + d, mask=d_ok)[None, :]
    hq = tl.arange(0, Q_HEADS_PAD)[:, None]
    q_mask = (hq < NUM_Q_HEADS) & d_ok[None, :]
    q_lo = q_ptr + token * stride_q_t + hq * stride_q_h + d[None, :]
    x1 = tl.load(q_lo, mask=q_mask)
    x2 = tl.load(q_lo + HALF, mask=q_mask)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(q_lo, (a * cos - b * sin).to(x1.dtype), mask=q_mask)
    tl.store(q_lo + HALF, (b * cos + a * sin).to(x1.dtype), mask=q_mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * (
        NUM_KV_HEADS * HEAD_DIM
    )
    hk = tl.arange(0, KV_HEADS_PAD)[:, None]
    k_mask = (hk < NUM_KV_HEADS) & d_ok[None, :]
    k_lo = k_ptr + token * stride_k_t + hk * stride_k_h + d[None, :]
    y1 = tl.load(k_lo, mask=k_mask)
    y2 = tl.load(k_lo + HALF, mask=k_mask)
    a, b = y1.to(tl.float32), y2.to(tl.float32)
    # rounded to the model dtype first (the torch path rotates k in place, then writes it)
    k1 = (a * cos - b * sin).to(y1.dtype).to(k_cache_ptr.dtype.element_ty)
    k2 = (b * cos + a * sin).to(y1.dtype).to(k_cache_ptr.dtype.element_ty)
    dst = k_cache_ptr + row + hk * HEAD_DIM + d[None, :]
    tl.store(dst, k1, mask=k_mask)
    tl.store(dst + HALF, k2, mask=k_mask)
    dv = tl.arange(0, DIM_PAD)[None, :]
    v_mask = (hk < NUM_KV_HEADS) & (dv < HEAD_DIM)
    val = tl.load(v_ptr + token * stride_v_t + hk * stride_v_h + dv, mask=v_mask)
    tl.store(v_cache_ptr + row + hk * HEAD_DIM + dv, val.to(v_cache_ptr.dtype.element_ty),
             mask=v_mask)  # fmt: skip


def rope_write_kv(
    q: torch.Tensor,  # [T, Hq, D], head_dim contiguous; rotated in place
    k: torch.Tensor,  # [T, Hkv, D]; rotated into the cache (k itself is left as is)
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # int [T]
    cos: torch.Tensor,  # fp32 [max_positions, D // 2]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int [T]; < 0 = no cache write (q is still rotated)
) -> torch.Tensor:
    """RoPE of q (in place) and of the new keys, and the KV-cache write, in one launch."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and cache_dim == head_dim
    assert k_cache.stride()[1:] == (num_kv_heads * head_dim, head_dim, 1), "cache rows"
    assert v_cache.stride() == k_cache.stride(), "k and v caches must share strides"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert cos.stride() == sin.stride() and cos.stride(1) == 1 and head_dim % 2 == 0
    if num_tokens == 0:
        return q
    half = head_dim // 2
    _rope_write_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half),
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4 if num_q_heads * half >= 1024 else 1,
    )
    return q
