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
