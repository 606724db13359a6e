"""RMSNorm with the residual add fused in: one launch instead of ~8 eager ops per norm.

Rounding matches the torch path in engine.model.RMSNorm: the sum x + residual is rounded to the
model dtype (it is the new residual stream), normalised in fp32, rounded, then scaled by the
weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,  # read, then overwritten with x + residual (when HAS_RESIDUAL)
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (engine.kernels.pdl)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    w = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)  # weights: before the wait
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (
            x.to(tl.float32)
            + tl.load(residual_ptr + row * stride_r + cols, mask=mask).to(tl.float32)
        ).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    y = normalize_row(x, w, size, eps)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def normalize_row(x, w, size, eps):
    """A row of the model dtype (masked tail zero) -> x / rms(x) rounded to that dtype, times
    the float32 weights `w`, in float32 (engine.model.RMSNorm's rounding)."""
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / size + eps)
    return (x32 * rstd).to(x.dtype).to(tl.float32) * w


def norm_warps(block: int) -> int:
    """Warps of a norm kernel's program over a row of `block` (a power of two) elements."""
    return min(max(block // 512, 1), 16)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]; updated in place to x + residual
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); without a residual, (norm(x), x)."""
    num_rows, size = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty_like(x)
    if num_rows == 0:
        return out, x if residual is None else residual
    block = triton.next_power_of_2(size)
    use_pdl = pdl.enabled(x)
    _rms_norm_kernel[(num_rows,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        PDL=use_pdl,
        num_warps=norm_warps(block),
        **pdl.launch_options(use_pdl),
    )
    return out, x if residual is None else residual
