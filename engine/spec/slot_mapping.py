"""A speculative step's device-side input work in one kernel: input ids from the token source
and, with seed 5 (vLLM PR 32951, optimistic speculative scheduling), the correction of the
positions the CPU assumed.

Input ids. The host writes -(i + 1) for a token the device holds (`token_source[i]`: a slot's last
sampled token or a draft of the device draft table, engine.spec.inputs); the device resolves them:

    resolved[t]  = token_source[-1 - raw[t]] if raw[t] < 0 else raw[t]   (drafts may be -1)
    input_ids[t] = max(resolved[t], 0)

Correction (seed 5 on). With batches in flight the CPU prepares step i+1 before step i's
verification is known and assumes every draft of the in-flight steps is accepted: a request's
start position (and so its positions, seq_len and KV slots) may be too far ahead by the drafts
those steps reject. Stream order puts this after their results, so every row shifts back:

    shift[b] = rejected_total[row_slot[b]] - known[b]
    positions[t] -= shift[b]      for t in query_start_loc[b] .. query_start_loc[b+1] - 1
    seq_lens[b]  -= shift[b]
    slot_mapping[t] = block_table[row_slot[b], positions[t] // block_size] * block_size
                      + positions[t] % block_size
    aux[a, t]    -= shift[b]      where aux[a, t] >= 0 (the sampling output / forced indices)

`rejected_total[s]` (device, per request slot) counts the drafts rejected so far for the slot's
request; `known[b]` (host-written) is the part of it the CPU had applied when it prepared the row,
so shift = the rejections of steps still in flight when the CPU prepared (0 for a row that was not
in one, e.g. a prefill). Blocks were allocated for the optimistic (longer) length, so every
corrected position has a block (`block_table` is the per-slot table). Query lengths are unchanged
(uniform k), so token order, input ids and logits rows stay as prepared.

Why one kernel: vLLM's correction costs microseconds inside compiled code; a correction launched
from Python as its own kernel (plus the ids' five torch ops) cost this engine more host time per
step than the wait it removes (reports/ablate.md). Here seed 5 on and off launch the same kernel;
on only sets `fix`. Its pointer arguments are whole buffers (fixed addresses, fixed alignment) and
its sizes are not specialised, so it compiles once per process.

Layout read (engine.spec.inputs): `rows` int32 [F, R] with fields QSL (B + 1 values), SEQ_LENS,
ROW_SLOT, KNOWN; `toks` int32 [>= 5 t] = [raw ids | positions | slot_mapping | out_idx |
forced_idx], each t long (t = tokens incl. graph padding; tokens past query_start_loc[B] belong to
no row: their ids are resolved, nothing else is touched).

`finish_inputs` picks the Triton kernel on CUDA (or under TRITON_INTERPRET=1) and the torch
version otherwise; both only enqueue device work (no host reads).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

BLOCK_TOKENS = 128  # tokens per inner iteration: a decode row has k + 1, a prefill chunk more
NUM_AUX = 2  # aux rows after the slot mapping: out_idx, forced_idx

if triton is not None:

    @triton.jit(do_not_specialize=["t", "num_rows", "fix"])
    def _finish_kernel(
        rows_ptr,
        toks_ptr,
        source_ptr,
        resolved_ptr,
        ids_ptr,
        rejected_ptr,
        table_ptr,
        row_stride,
        table_stride,
        block_size,
        t,
        num_rows,
        fix,
        QSL: tl.constexpr,
        SEQ_LENS: tl.constexpr,
        ROW_SLOT: tl.constexpr,
        KNOWN: tl.constexpr,
        NUM_AUX: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)  # batch row b < num_rows; b == num_rows: the padding tokens
        is_row = b < num_rows
        start = tl.load(rows_ptr + QSL * row_stride + b)
        end = tl.load(rows_ptr + QSL * row_stride + b + 1, mask=is_row, other=0)
        end = tl.where(is_row, end, t)
        do_fix = is_row & (fix != 0)
        slot = tl.load(rows_ptr + ROW_SLOT * row_stride + b, mask=do_fix, other=0).to(tl.int64)
        known = tl.load(rows_ptr + KNOWN * row_stride + b, mask=do_fix, other=0)
        rejected = tl.load(rejected_ptr + slot, mask=do_fix, other=0)
        shift = tl.where(do_fix, rejected - known, 0).to(tl.int32)
        seq_len = tl.load(rows_ptr + SEQ_LENS * row_stride + b, mask=do_fix, other=0)
        tl.store(rows_ptr + SEQ_LENS * row_stride + b, seq_len - shift, mask=do_fix)
        fix_end = tl.where(do_fix, end, start)  # tokens to correct: start .. fix_end - 1
        for off in range(start, end, BLOCK):
            i = off + tl.arange(0, BLOCK)
            m = i < end
            raw = tl.load(toks_ptr + i, mask=m, other=0)
            held = raw < 0
            src = tl.load(source_ptr + tl.maximum(-1 - raw, 0), mask=m & held, other=0)
            res = tl.where(held, src, raw)
            tl.store(resolved_ptr + i, res, mask=m)
            tl.store(ids_ptr + i, tl.maximum(res, 0), mask=m)
            mf = i < fix_end
            p = tl.load(toks_ptr + t + i, mask=mf, other=0) - shift
            tl.store(toks_ptr + t + i, p, mask=mf)
            blk = tl.load(table_ptr + slot * table_stride + p // block_size, mask=mf, other=0)
            tl.store(toks_ptr + 2 * t + i, blk * block_size + p % block_size, mask=mf)
            for a in tl.static_range(NUM_AUX):
                x = tl.load(toks_ptr + (3 + a) * t + i, mask=mf, other=-1)
                tl.store(toks_ptr + (3 + a) * t + i, tl.where(x >= 0, x - shift, x), mask=mf)


def use_triton(device: torch.device) -> bool:
    return triton is not None and (
        device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    )


def finish_inputs(
    rows: torch.Tensor,  # int32 [F, R], fields QSL / SEQ_LENS (in place) / ROW_SLOT / KNOWN
    fields: tuple[int, int, int, int],  # (QSL, SEQ_LENS, ROW_SLOT, KNOWN) row indices
    toks: torch.Tensor,  # int32 [>= 5 t] token block, positions / slot_mapping / aux in place
    t: int,  # tokens laid out (incl. padding)
    num_rows: int,  # B
    token_source: torch.Tensor,  # int32: what -(i + 1) refers to
    resolved: torch.Tensor,  # int32 [>= t] out
    input_ids: torch.Tensor,  # int32 [>= t] out
    rejected_total: torch.Tensor,  # int32 [num_slots]
    block_table: torch.Tensor,  # int32 [num_slots, max_blocks], per request slot
    block_size: int,
    fix: bool,  # seed 5: correct by rejected_total - known
    triton_kernel: bool | None = None,
) -> None:
    if triton_kernel is None:
        triton_kernel = use_triton(toks.device)
    args = (rows, fields, toks, t, num_rows, token_source, resolved, input_ids)
    fn = _finish_triton if triton_kernel else finish_inputs_torch
    fn(*args, rejected_total, block_table, block_size, fix)


def _finish_triton(rows, fields, toks, t, b, source, resolved, ids, rejected, table, bs, fix):
    for x in (rows, toks, source, resolved, ids, rejected):
        assert x.is_contiguous() and x.dtype == torch.int32
    assert table.stride(1) == 1 and table.dtype == torch.int32
    qsl, seq_lens, row_slot, known = fields
    _finish_kernel[(b + 1,)](
        rows,
        toks,
        source,
        resolved,
        ids,
        rejected,
        table,
        rows.stride(0),
        table.stride(0),
        bs,
        t,
        b,
        int(fix),
        QSL=qsl,
        SEQ_LENS=seq_lens,
        ROW_SLOT=row_slot,
        KNOWN=known,
        NUM_AUX=NUM_AUX,
        BLOCK=BLOCK_TOKENS,
    )


def finish_inputs_torch(rows, fields, toks, t, b, source, resolved, ids, rejected, table, bs, fix):
    """The same with torch ops (CPU; the tests' second implementation)."""
    raw = toks[:t]
    src = (-1 - raw).clamp_(min=0)
    torch.where(raw < 0, source[src], raw, out=resolved[:t])
    torch.clamp(resolved[:t], min=0, out=ids[:t])
    if not fix or b == 0:
        return
    qsl, seq_lens, row_slot, known = fields
    slots = rows[row_slot, :b].long()
    correct_inputs_torch(
        rows[qsl, : b + 1],
        rows[row_slot, :b],
        rows[known, :b],
        rejected,
        toks[t : 2 * t],
        rows[seq_lens, :b],
        toks[2 * t : 3 * t],
        table[slots],
        bs,
        toks[3 * t : (3 + NUM_AUX) * t].view(NUM_AUX, t),
    )


def correct_inputs_torch(qsl, row_slot, known, rejected, positions, seq_lens, smap, table, bs, aux):
    """The correction alone with torch ops, on separate tensors (`table` row b = batch row b's
    blocks): the reference the kernel is tested against."""
    b = seq_lens.shape[0]
    if b == 0:
        return
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
