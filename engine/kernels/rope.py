"""Rotary position embedding applied in place (rotate-half form, as HF Llama), one launch for
the query and key heads together: x is [T, H, D] (e.g. the q|k columns of the fused qkv output,
viewed per head), cos/sin are the model's fp32 caches [max_positions, D // 2]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_x_t,
    stride_x_h,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    h = tl.arange(0, HEADS_PAD)
    cos = tl.load(cos_ptr + pos * stride_cs + d, mask=d < HALF)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cs + d, mask=d < HALF)[None, :]
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HALF)
    first = x_ptr + token * stride_x_t + h[:, None] * stride_x_h + d[None, :]
    x1 = tl.load(first, mask=mask)
    x2 = tl.load(first + HALF, mask=mask)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


def rope_inplace(
    x: torch.Tensor,  # [T, H, D], head_dim contiguous; rotated in place
    positions: torch.Tensor,  # int [T]
    cos: torch.Tensor,  # fp32 [max_positions, D // 2]
    sin: torch.Tensor,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(2) == 1 and cos.stride() == sin.stride() and cos.stride(1) == 1
    if num_tokens == 0:
        return x
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        x,
        positions,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        NUM_HEADS=num_heads,
        HALF=half,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4 if num_heads * half >= 1024 else 1,
    )
    return x
