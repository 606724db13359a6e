"""Seed 5 (vLLM PR 32951), optimistic speculative scheduling: the GPU corrects the next step's
inputs, so the CPU never waits for accepted counts.

With batches in flight, the CPU prepares step i+1 before step i's verification is known and
assumes every draft of the in-flight steps is accepted: a request's start position (and so its
positions, seq_len and KV slots) may be too far ahead by the drafts those steps reject. Once step
i's results exist on the device (stream order: this runs after them), shift every row back:

    shift[b] = rejected_total[row_slot[b]] - known[b]
    positions[t] -= shift[b]      for t in query_start_loc[b] .. query_start_loc[b+1] - 1
    seq_lens[b]  -= shift[b]
    slot_mapping[t] = block_table[b, positions[t] // block_size] * block_size
                      + positions[t] % block_size
    aux[a, t]    -= shift[b]      where aux[a, t] >= 0 (e.g. sampling output indices)

`rejected_total[s]` (device, per request slot) counts the drafts rejected so far for the slot's
request; `known[b]` (host-written) is the part of it the CPU had applied when it prepared the row,
so shift = the rejections of steps still in flight when the CPU prepared (0 for a row that was not
in one, e.g. a prefill). Blocks were allocated for the optimistic (longer) length, so every
corrected position has a block. Query lengths are unchanged (uniform k), so token order, input
ids and logits rows stay as prepared.

`correct_inputs` picks the Triton kernel on CUDA (or under TRITON_INTERPRET=1) and the torch
fallback otherwise; both only enqueue device work (no host reads).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

BLOCK_TOKENS = 16  # tokens per inner iteration; a row has k + 1 (<= 17) tokens or a chunk

if triton is not None:

    @triton.jit
    def _correct_kernel(
        qsl_ptr,
        row_slot_ptr,
        known_ptr,
        rejected_ptr,
        positions_ptr,
        seq_lens_ptr,
        slot_mapping_ptr,
        block_table_ptr,
        aux_ptr,
        stride_bt,
        stride_aux,
        block_size,
        NUM_AUX: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        start = tl.load(qsl_ptr + b)
        end = tl.load(qsl_ptr + b + 1)
        slot = tl.load(row_slot_ptr + b).to(tl.int64)
        shift = (tl.load(rejected_ptr + slot) - tl.load(known_ptr + b)).to(tl.int32)
        tl.store(seq_lens_ptr + b, tl.load(seq_lens_ptr + b) - shift)
        for off in range(start, end, BLOCK):
            t = off + tl.arange(0, BLOCK)
            m = t < end
            p = tl.load(positions_ptr + t, mask=m, other=0) - shift
            tl.store(positions_ptr + t, p, mask=m)
            blk = tl.load(block_table_ptr + b * stride_bt + p // block_size, mask=m, other=0)
            tl.store(slot_mapping_ptr + t, blk * block_size + p % block_size, mask=m)
            for a in tl.static_range(NUM_AUX):
                x = tl.load(aux_ptr + a * stride_aux + t, mask=m, other=-1)
                tl.store(aux_ptr + a * stride_aux + t, tl.where(x >= 0, x - shift, x), mask=m)


def use_triton(device: torch.device) -> bool:
    return triton is not None and (
        device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    )


def correct_inputs(
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    row_slot: torch.Tensor,  # int32 [B]
    known: torch.Tensor,  # int [B]
    rejected_total: torch.Tensor,  # int [num_slots]
    positions: torch.Tensor,  # int32 [T], corrected in place
    seq_lens: torch.Tensor,  # int32 [B], in place
    slot_mapping: torch.Tensor,  # int32/int64 [T], in place (tokens past qsl[B] untouched)
    block_table: torch.Tensor,  # int32 [B, max_blocks], row b = batch row b's blocks
    block_size: int,
    aux: torch.Tensor | None = None,  # int32 [A, T], in place where >= 0
    triton_kernel: bool | None = None,
) -> None:
    b = seq_lens.shape[0]
    if b == 0:
        return
    if triton_kernel is None:
        triton_kernel = use_triton(positions.device)
    fn = _correct_triton if triton_kernel else correct_inputs_torch
    fn(
        query_start_loc,
        row_slot,
        known,
        rejected_total,
        positions,
        seq_lens,
        slot_mapping,
        block_table,
        block_size,
        aux,
    )


def _correct_triton(qsl, row_slot, known, rejected, positions, seq_lens, smap, table, bs, aux):
    b = seq_lens.shape[0]
    num_aux = 0 if aux is None else aux.shape[0]
    for t in (qsl, row_slot, known, rejected, positions, seq_lens, smap):
        assert t.is_contiguous()
    assert table.stride(1) == 1 and (aux is None or aux.stride(1) == 1)
    _correct_kernel[(b,)](
        qsl,
        row_slot,
        known,
        rejected,
        positions,
        seq_lens,
        smap,
        table,
        positions if aux is None else aux,
        table.stride(0),
        0 if aux is None else aux.stride(0),
        bs,
        NUM_AUX=num_aux,
        BLOCK=BLOCK_TOKENS,
    )


def correct_inputs_torch(qsl, row_slot, known, rejected, positions, seq_lens, smap, table, bs, aux):
    """The same correction with torch ops (CPU; tests' second implementation)."""
    b = seq_lens.shape[0]
    t = positions.shape[0]
    dev = positions.device
    shift = (rejected[row_slot.long()] - known).to(torch.int32)  # [B]
    tok = torch.arange(t, device=dev)
    row = torch.searchsorted(qsl[1 : b + 1].long(), tok, right=True)  # B = owned by no row
    owned = row < b
    row = row.clamp(max=b - 1)
    tok_shift = torch.where(owned, shift[row], 0)
    seq_lens.sub_(shift)
    positions.sub_(tok_shift.to(positions.dtype))
    p = positions.long()
    col = torch.where(owned, p // bs, 0)
    slots = table[row, col].long() * bs + p % bs
    smap.copy_(torch.where(owned, slots, smap.long()).to(smap.dtype))
    if aux is not None:
        aux.copy_(torch.where(aux >= 0, aux - tok_shift[None, :], aux))
