"""Small per-step kernels of plain decoding that replace chains of eager torch ops.

- `greedy_sample`: argmax over the vocabulary of each logits row, then the forced token where
  there is one, written to the step's output row and to the slot's last sampled token. Two
  launches (chunk maxima, then the merge with the writes) instead of torch's single-program
  argmax (~28 us for one 128k row on an H200: one block walks the whole row) and the 4-5 ops
  after it.
- `resolve_input_ids`: decode input ids from the slots' last sampled tokens (host id -(s + 1)
  means "last token of slot s"): one launch instead of five.

Ties: the lowest index of the maximum, as torch.argmax (chunks cover increasing indices, and the
merge takes the lowest index among the chunks that hold the maximum). NaN counts as the maximum,
as in torch.argmax: the first NaN's index, so the token is always a valid id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import pdl

CHUNK = 4096  # logits per program of the first stage


@triton.jit
def _chunk_max_kernel(
    logits_ptr,
    stride_row,
    vocab,
    part_max_ptr,  # [rows, NUM_CHUNKS] fp32
    part_idx_ptr,  # [rows, NUM_CHUNKS] int32
    NUM_CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (engine.kernels.pdl)
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, 0)
    i = tl.min(tl.where(x == m, offs, 2147483647), 0)
    nan_i = tl.min(tl.where(x != x, offs, 2147483647), 0)  # NaN is the max, as in torch
    has_nan = nan_i < 2147483647
    tl.store(part_max_ptr + row * NUM_CHUNKS + chunk, tl.where(has_nan, float("nan"), m))
    tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, tl.where(has_nan, nan_i, i))


@triton.jit
def _merge_kernel(
    part_max_ptr,
    part_idx_ptr,
    forced_ptr,  # [rows] int32: the forced token, -1 = none
    slot_ptr,  # [rows] int32: the row's slot in last_sampled
    out_ptr,  # [rows] int32
    last_ptr,  # [slots] int32
    NUM_CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < NUM_CHUNKS
    forced = tl.load(forced_ptr + row)  # step inputs: before the wait
    slot = tl.load(slot_ptr + row)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    m = tl.load(part_max_ptr + row * NUM_CHUNKS + c, mask=mask, other=float("-inf"))
    i = tl.load(part_idx_ptr + row * NUM_CHUNKS + c, mask=mask, other=2147483647)
    best = tl.max(m, 0)
    tok = tl.min(tl.where(m == best, i, 2147483647), 0)
    nan_tok = tl.min(tl.where(m != m, i, 2147483647), 0)  # a NaN chunk wins (lowest index)
    tok = tl.where(nan_tok < 2147483647, nan_tok, tok)
    tok = tl.where(forced >= 0, forced, tok)
    tl.store(out_ptr + row, tok)
    tl.store(last_ptr + slot, tok)


class GreedyWorkspace:
    """The partial maxima of up to `max_rows` rows (preallocated: no allocation per step, and
    fixed addresses inside CUDA graphs)."""

    def __init__(self, max_rows: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.num_chunks = triton.cdiv(vocab, CHUNK)
        self.part_max = torch.empty((max_rows, self.num_chunks), dtype=torch.float32, device=device)
        self.part_idx = torch.empty((max_rows, self.num_chunks), dtype=torch.int32, device=device)


def check_greedy_args(logits: torch.Tensor, ws: GreedyWorkspace) -> None:
    """What `greedy_sample` needs of its logits [G, vocab]: the workspace's vocab, G <= its rows,
    unit stride along the vocab (host-side shape checks only: CPU tests run it too)."""
    rows, vocab = logits.shape
    assert vocab == ws.vocab and rows <= ws.part_max.shape[0] and logits.stride(1) == 1, (
        f"greedy_sample: logits {rows} x {vocab} (stride {tuple(logits.stride())}) for a "
        f"workspace of {ws.part_max.shape[0]} rows x vocab {ws.vocab}"
    )


def greedy_sample(
    logits: torch.Tensor,  # [G, vocab] float
    forced: torch.Tensor,  # [G] int32, -1 = not forced
    slots: torch.Tensor,  # [G] int32
    out: torch.Tensor,  # [G] int32
    last_sampled: torch.Tensor,  # [S] int32, last_sampled[slots[g]] = out[g]
    ws: GreedyWorkspace,
) -> None:
    """out[g] = forced[g] if >= 0 else argmax(logits[g]); last_sampled[slots[g]] = out[g]."""
    check_greedy_args(logits, ws)
    rows, vocab = logits.shape
    if rows == 0:
        return
    n, on = ws.num_chunks, pdl.enabled(logits)
    _chunk_max_kernel[(rows, n)](
        logits, logits.stride(0), vocab, ws.part_max, ws.part_idx, NUM_CHUNKS=n, CHUNK=CHUNK,
        PDL=on, **pdl.launch_options(on),
    )  # fmt: skip
    block = triton.next_power_of_2(n)
    _merge_kernel[(rows,)](
        ws.part_max, ws.part_idx, forced, slots, out, last_sampled, NUM_CHUNKS=n, BLOCK=block,
        PDL=on, **pdl.launch_options(on),
    )  # fmt: skip


@triton.jit
def _resolve_ids_kernel(raw_ptr, last_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    raw = tl.load(raw_ptr + offs, mask=mask, other=0)
    from_slot = raw < 0
    last = tl.load(last_ptr + (-1 - raw), mask=mask & from_slot, other=0)
    tl.store(out_ptr + offs, tl.where(from_slot, last, raw), mask=mask)


def resolve_input_ids(raw: torch.Tensor, last_sampled: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = last_sampled[-1 - raw[i]] where raw[i] < 0, else raw[i] (int32 [n])."""
    n = raw.numel()
    if n == 0:
        return
    block = min(1024, triton.next_power_of_2(n))
    _resolve_ids_kernel[(triton.cdiv(n, block),)](raw, last_sampled, out, n, BLOCK=block)
