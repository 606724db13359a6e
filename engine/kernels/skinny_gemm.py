"""Skinny GEMM out[M, N] = x[M, K] @ w[N, K]^T for few rows (small decode batches, M <= 16), with
the layer's element-wise neighbours fused in, so a decode layer is 5 launches (qkv, attention, o,
gate_up, down) instead of ~12.

Each program streams BLOCK_N weight rows over all of K through a pipelined tl.dot (cp.async
stages; the rows of x padded to BLOCK_M = 16). At M = 1 on an H200 this read the decode weights
faster than cuBLAS (docs/engine-perf.md). Optional fusions (constexpr):
- NORM: x := RMSNorm(x) * norm_w. Each K tile is multiplied by norm_w (rounded to the model dtype)
  and the sum of squares is accumulated alongside; the per-row 1/rms scales the fp32 accumulator
  after the loop, so no extra pass over x. (The eager path rounds x * rstd before the weight
  multiply; this rounds x * norm_w instead: the same bf16-level error.)
- SILU_MUL: x is [M, 2K] = [gate | up]; x := silu(gate) * up, rounded as the eager path does.
- RESIDUAL: res := res + out (out rounded to the model dtype first), written in place into res;
  each program owns its BLOCK_N columns, so no two programs touch one element.
The output dtype is out's (fp32 logits straight from the accumulator, for one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # BLOCK_M: rows of x one program carries


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    norm_w_ptr,  # [K] (NORM)
    res_ptr,  # [M, N] residual, updated in place (RESIDUAL)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    SILU_MUL: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sum_sq = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        if SILU_MUL:
            up = tl.load(x_ptrs + K, mask=m_ok[:, None], other=0.0)
            g = x.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
            x = (act * up.to(tl.float32)).to(x.dtype)
        if NORM:
            x32 = x.to(tl.float32)
            sum_sq += tl.sum(x32 * x32, 1)
            nw = tl.load(norm_w_ptr + k * BLOCK_K + rk).to(tl.float32)
            x = (x32 * nw[None, :]).to(x.dtype)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if NORM:
        acc = acc * (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
    mask = m_ok[:, None] & n_ok[None, :]
    if RESIDUAL:
        r_ptrs = res_ptr + rm[:, None] * stride_rm + rn[None, :]
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        y = acc.to(r.dtype).to(tl.float32) + r.to(tl.float32)
        tl.store(r_ptrs, y.to(r.dtype), mask=mask)
    else:
        tl.store(
            out_ptr + rm[:, None] * stride_om + rn[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


def default_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_stages, num_warps) for the decode shapes (H200 sweep, M = 1):
    about one program per SM for the 4-6k-row projections, deep cp.async pipelines."""
    if n <= 4096:
        cfg = (32, 256, 6, 4)
    elif n <= 8192:
        cfg = (64, 128, 6, 4)
    elif n <= 32768:
        cfg = (128, 128, 4, 8)
    else:
        cfg = (32, 256, 4, 4)
    block_k = cfg[1]
    while k % block_k:
        block_k //= 2
    return cfg[0], block_k, cfg[2], cfg[3]


def supports(k: int) -> bool:
    """Inner sizes the kernel takes (whole 16-wide tiles)."""
    return k % 16 == 0


def skinny_gemm(
    x: torch.Tensor,  # [M, K] (SILU_MUL: [M, 2K]), M <= MAX_ROWS, unit column stride
    w: torch.Tensor,  # [N, K]
    norm_weight: torch.Tensor | None = None,  # [K]: x := RMSNorm(x) * norm_weight first
    eps: float = 1e-5,
    silu_mul: bool = False,  # x = [gate | up]: x := silu(gate) * up first
    residual: torch.Tensor | None = None,  # [M, N]: residual += out, in place; returns it
    out_dtype: torch.dtype | None = None,  # default x.dtype
    config: tuple[int, int, int, int] | None = None,  # (block_n, block_k, stages, warps)
) -> torch.Tensor:
    m = x.shape[0]
    n, k = w.shape
    assert x.shape[1] == (2 * k if silu_mul else k), "x does not match w"
    assert m <= MAX_ROWS and supports(k) and x.stride(1) == 1 and w.stride(1) == 1
    assert norm_weight is None or norm_weight.shape == (k,)
    block_n, block_k, stages, warps = config or default_config(n, k)
    assert k % block_k == 0
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(1) == 1
        out = residual
    else:
        out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        out,
        norm_weight if norm_weight is not None else w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        out.stride(0),
        eps,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NORM=norm_weight is not None,
        SILU_MUL=silu_mul,
        RESIDUAL=residual is not None,
        num_warps=warps,
        num_stages=stages,
    )
    return out
