"""Skinny GEMM out[M, N] = x[M, K] @ w[N, K]^T for few rows (small decode batches, M <= 16).

Each program streams BLOCK_N weight rows over all of K through a pipelined tl.dot (cp.async
stages; the rows of x padded to BLOCK_M = 16). At M = 1 on an H200 it reads the decode weights
faster than cuBLAS, which also adds a split-K reduce kernel to two of the four projections
(docs/engine-perf.md). Both operands go from memory straight into the dot: an x operand
transformed in registers inside the K loop (an RMSNorm or SiLU*up prologue) made the kernel 2x to
12x slower on Triton 3.6, while epilogues cost nothing, so the only fusions are epilogues:
- SILU_MUL: w is [gate; up] (2N rows); the program keeps one accumulator for gate rows j and one
  for up rows j and writes silu(gate) * up [M, N], rounded as the eager path rounds
  (gate and up to the model dtype, SiLU in fp32 rounded, the product rounded).
- the output dtype is out's: fp32 logits straight from the accumulator, for one.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import pdl

MAX_ROWS = 16  # BLOCK_M: rows of x one program carries
# weight bytes a program asks into L2 before its wait (PDL); ENGINE_PREFETCH_KB tunes it
PREFETCH_BYTES = int(os.environ.get("ENGINE_PREFETCH_KB", "16")) << 10


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 of each address (a hint: no value, never faults on valid memory)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,  # output columns (SILU_MUL: w has 2N rows)
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (engine.kernels.pdl): prefetch, then wait
    PREFETCH_LINES: tl.constexpr,  # 128-byte lines per weight row to prefetch (power of 2)
    LINE: tl.constexpr,  # elements per 128-byte line
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    if PDL:  # the weights depend on no kernel: start their first lines, then wait for x
        rows = tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_wn
        cols = tl.arange(0, PREFETCH_LINES)[None, :] * LINE
        _prefetch_l2(w_ptr + rows + cols)
        if SILU_MUL:
            _prefetch_l2(w_ptr + N * stride_wn + rows + cols)
        gdc_wait()
        gdc_launch_dependents()
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    up_ptrs = w_ptr + (rn[:, None] + N).to(tl.int64) * stride_wn + rk[None, :]  # SILU_MUL
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if SILU_MUL:
            w_up = tl.load(up_ptrs, mask=n_ok[:, None], other=0.0)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
            up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ty = out_ptr.dtype.element_ty
    if SILU_MUL:
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        acc = act * acc_up.to(out_ty).to(tl.float32)
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def default_config(n: int, k: int, silu_mul: bool = False) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_stages, num_warps) for the decode shapes (H200 sweep, M = 1):
    about one program per SM for the 4-6k-row projections, deep cp.async pipelines; with
    SILU_MUL a program reads 2 x block_n weight rows."""
    rows = 2 * n if silu_mul else n
    if rows <= 4096:
        cfg = (32, 256, 6, 4)
    elif rows <= 8192:
        cfg = (64, 128, 6, 4)
    elif rows <= 32768:
        cfg = (64 if silu_mul else 128, 128, 4, 8)
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
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS, unit column stride
    w: torch.Tensor,  # [N, K] (silu_mul: [2N, K] = [gate; up])
    silu_mul: bool = False,  # out = silu(x @ gate^T) * (x @ up^T), [M, N]
    out_dtype: torch.dtype | None = None,  # default x.dtype
    config: tuple[int, int, int, int] | None = None,  # (block_n, block_k, stages, warps)
) -> torch.Tensor:
    m, k = x.shape
    rows, k_w = w.shape
    assert k == k_w and m <= MAX_ROWS and supports(k), "x does not match w"
    assert x.stride(1) == 1 and w.stride(1) == 1
    assert not silu_mul or rows % 2 == 0
    n = rows // 2 if silu_mul else rows
    block_n, block_k, stages, warps = config or default_config(n, k, silu_mul)
    assert k % block_k == 0
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    use_pdl = pdl.enabled(x)
    line = 128 // w.element_size()
    rows_per_program = 2 * block_n if silu_mul else block_n
    lines = max(1, min(k // line, PREFETCH_BYTES // (rows_per_program * 128)))
    lines = 1 << (lines.bit_length() - 1)  # a power of two (tl.arange)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SILU_MUL=silu_mul,
        PDL=use_pdl,
        PREFETCH_LINES=lines,
        LINE=line,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch_options(use_pdl),
    )
    return out
