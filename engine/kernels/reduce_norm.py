"""Tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it: one
launch where NCCL's ring all-reduce and the norm took two.

Every rank holds a partial sum x_r [T, H] (a row-parallel projection's output, or the
vocab-parallel embedding's). Program t of every rank (one row each):
1. pushes its row t into slot (`region`, own rank) of every peer's symmetric-memory buffer
   (NVLink stores; the buffer's address is fixed, so the launch is capturable in a CUDA graph);
2. meets the peers' program t at a cross-GPU barrier: it raises its flag in each peer's flag
   array (compare-and-swap 0 -> 1, release, system scope: its row's stores are visible first)
   and takes each peer's flag in its own array (1 -> 0, acquire). A flag still raised from the
   call before makes the raise spin until that peer has taken it, so calls pair up in order;
3. sums the W rows in rank order in float32 (its own from registers, the peers' from its own
   buffer), rounds to the model dtype (what an all-reduce returns), then does exactly what
   engine.kernels.rms_norm does: residual add rounded to the dtype (the new residual stream,
   written to `residual_out`), normalise in float32, round, scale.
Every rank sums the same values in the same order, so every rank's residual stream stays
bit-identical.

Buffer reuse: a rank pushes into a peer's slot of `region` only after it has passed the barrier
of the call before, which the peer reaches only after it finished reading its slots of the call
before that. So a region may serve every second call (engine.tp.comm.ReduceNorm: the forward's
first call takes region 0, the others alternate between 1 and 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import pdl
from engine.kernels.rms_norm import norm_warps, normalize_row

NUM_REGIONS = 3  # slots: the forward's first call, then two alternating (module docstring)


@triton.jit
def _reduce_norm_kernel(
    x_ptr,  # [T, H] this rank's partial sum
    residual_ptr,  # [T, H] read (HAS_RESIDUAL)
    residual_out_ptr,  # [T, H] the new residual stream: sum (+ residual)
    weight_ptr,  # [H]
    out_ptr,  # [T, H] norm(sum + residual) * weight
    data_ptrs,  # int64 [W]: each rank's data area (symmetric memory)
    flag_ptrs,  # int64 [W]: each rank's int32 flags [max_rows, W]
    region_offset,  # elements from a data area's start to (region, rank 0, row 0)
    slot_elems,  # elements of one rank's slot in a region: max_rows * H
    stride_x,
    stride_r,
    stride_o,
    size,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = x_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)  # weights: before the wait
    if PDL:
        gdc_wait()
    mine = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0)
    at = region_offset + RANK * slot_elems + row64 * size  # my row's place in every buffer
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            base = tl.load(data_ptrs + peer).to(tl.pointer_type(dtype))
            tl.store(base + at + cols, mine, mask=mask)
    tl.debug_barrier()  # every thread's stores issued before the flags go up
    my_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(flags + row * WORLD + RANK, 0, 1, sem="release", scope="sys") != 0:
                pass
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while (
                tl.atomic_cas(my_flags + row * WORLD + peer, 1, 0, sem="acquire", scope="sys") != 1
            ):
                pass
    tl.debug_barrier()  # the peers' rows are here for every thread
    if PDL:
        gdc_launch_dependents()
    own = tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype)) + region_offset + row64 * size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == RANK:
            acc += mine.to(tl.float32)
        else:
            acc += tl.load(
                own + peer * slot_elems + cols, mask=mask, other=0.0, cache_modifier=".cv"
            ).to(tl.float32)
    x = acc.to(dtype)  # the all-reduce's result
    if HAS_RESIDUAL:
        x = (
            x.to(tl.float32)
            + tl.load(residual_ptr + row64 * stride_r + cols, mask=mask).to(tl.float32)
        ).to(dtype)
    tl.store(residual_out_ptr + row64 * stride_r + cols, x, mask=mask)
    y = normalize_row(x, w, size, eps)
    tl.store(out_ptr + row64 * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_norm(
    x: torch.Tensor,  # [T, H] this rank's partial sum
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None,  # [T, H]; updated in place to sum + residual
    data_ptrs: torch.Tensor,  # int64 [W] on the device
    flag_ptrs: torch.Tensor,  # int64 [W] on the device
    rank: int,
    region: int,
    max_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual), sum + residual), sum over the W ranks of x; every rank calls it
    with the same T and region. Without a residual the sum is returned as the new residual."""
    num_rows, size = x.shape
    world = data_ptrs.numel()
    assert 0 < num_rows <= max_rows and 0 <= region < NUM_REGIONS
    assert x.stride(1) == 1 and (residual is None or residual.stride(0) == size)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is None else residual
    slot_elems = max_rows * size
    block = triton.next_power_of_2(size)
    use_pdl = pdl.enabled(x)
    _reduce_norm_kernel[(num_rows,)](
        x,
        residual_out if residual is None else residual,
        residual_out,
        weight,
        out,
        data_ptrs,
        flag_ptrs,
        region * world * slot_elems,
        slot_elems,
        x.stride(0),
        residual_out.stride(0),
        out.stride(0),
        size,
        eps,
        RANK=rank,
        WORLD=world,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        PDL=use_pdl,
        num_warps=norm_warps(block),
        **pdl.launch_options(use_pdl),
    )
    return out, residual_out
