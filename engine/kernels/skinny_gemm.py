"""Skinny GEMM out[M, N] = x[M, K] @ w[N, K]^T for few rows (M <= BLOCK_M, decode batches):
each program streams BLOCK_N weight rows over all of K through a pipelined tl.dot with the rows
of x padded to BLOCK_M (>= 16). Exploration only (bench/kernels.py --gemm): the model uses
cuBLAS unless this one proves faster at the decode shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def skinny_gemm(
    x: torch.Tensor,  # [M, K], M <= block_m
    w: torch.Tensor,  # [N, K]
    block_n: int = 32,
    block_k: int = 256,
    num_stages: int = 4,
    num_warps: int = 4,
    block_m: int = 16,
) -> torch.Tensor:
    m, k = x.shape
    n, k_w = w.shape
    assert k == k_w and k % block_k == 0 and m <= block_m
    assert x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
