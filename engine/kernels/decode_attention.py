"""Paged attention for an all-decode batch (one query token per sequence), with RoPE and the new
token's KV-cache write fused in: one launch per layer instead of rope + kv write + attention +
split reduce.

Batch layout as in `paged_attention`, specialised: row b is a real sequence iff
query_start_loc[b+1] > query_start_loc[b], and then its query token is token b (every real row
owns exactly one token and the graph padding rows come last, so query_start_loc[b] = b). It has
seq_lens[b] keys including the new one, and its query sits at position seq_lens[b] - 1 (the RoPE
position), so it sees every key.

Grid: (sequence, kv head, split). A program takes the GROUP query heads of one kv head (rows
padded to GROUP_PAD >= 16 for tl.dot). The keys of a sequence are cut at run time into at most
NUM_SPLITS runs of whole BLOCK_N tiles from its real seq_len, so the split count may come from the
batch size alone (a CUDA graph captured for max_model_len behaves like one for the real context);
splits past the last tile exit at once.

Fused pieces (decode is latency-bound at small batch: each dependent global load is ~1 us, so
every load that depends on nothing is issued first):
- ROPE: q and the new key are rotated in registers on full rows, x * cos + sign * swap(x) * sin
  (swap = the other half, loaded as a second gather), in fp32 and rounded to the model dtype as
  `engine.model.RotaryEmbedding` does; q and k are read straight from the qkv output.
- WRITE_KV: the new token's K/V are not read back from the cache: the split that covers the last
  position starts its online softmax from the new key (weight 1 at its score, acc = v) and masks
  that position in its tiles; it also writes the rotated key and the value to the cache at
  slot_mapping[token] (slot < 0: no write) for later steps. No program of this launch reads it.
- Split merge: with more than one active split, each writes an unnormalised fp32 partial (acc,
  running max in log2 units, running sum) and bumps the (sequence, kv head) counter with an
  acq_rel atomic after a CTA barrier; the last one to arrive merges all partials of its kv head in
  one [split, head, dim] load (L2, .cg) and resets the counter to 0, so the counters are all 0
  between launches. Launches that share the counters must be stream-ordered (they are: the engine
  runs one compute stream).

All sizes come from tensors or constexprs; the host reads no tensor values (CUDA-graph safe).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import pdl

_LOG2E = 1.4426950408889634
TARGET_PROGRAMS_PER_SM = 2  # split until (seqs x kv heads x splits) reaches this many per SM
MAX_SPLITS = 32
# Large batches (enough (sequence, kv head) programs to fill the GPU) split a sequence only per
# LONG_SPLIT_KEYS keys, up to MAX_LONG_SPLITS ways: uniform short contexts keep one program per
# (sequence, kv head), while one long sequence in the batch no longer walks all its tiles
# serially (a 38k-token context took 1.2 ms per layer at ~2 us per tile, ~40 ms per step).
LONG_SPLIT_KEYS = 4096
MAX_LONG_SPLITS = 8
NUM_COUNTERS = 1 << 14  # (seq, kv head) pairs a split launch may use; splits need few programs


@triton.jit
def _normalise_and_store(acc, l_i, out_ptr, token, head, dims, row_ok, dim_ok, stride_o_t,
                         stride_o_h):  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit(do_not_specialize=["min_tiles"])
def _decode_attention_kernel(
    q_ptr,  # [T, Hq, D] view (e.g. columns of the fused qkv output)
    k_ptr,  # [T, Hkv, D] view: the new tokens' keys (before RoPE when ROPE)
    v_ptr,  # [T, Hkv, D] view
    cos_ptr,  # fp32 [max_positions, D // 2]
    sin_ptr,
    slot_mapping_ptr,
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,  # fp32 [T * Hq * NUM_SPLITS, HEAD_DIM]; only when NUM_SPLITS > 1
    part_ml_ptr,  # fp32 [T * Hq * NUM_SPLITS, 2]
    counter_ptr,  # int32 [>= B * Hkv], all 0 between launches
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    min_tiles,  # tiles a split takes at least (1, or LONG_SPLIT_KEYS // BLOCK_N)
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    stride_cs,
    stride_bt,
    stride_cache_block,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,  # next power of two of GROUP (merge tile)
    GROUP_PAD: tl.constexpr,  # >= 16 (tl.dot rows)
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ROPE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (engine.kernels.pdl): step metadata, then wait
):
    # Latency first: every load that needs no other load is issued before the first wait.
    # Token of sequence b is b (all decodes: query_start_loc[b] = b for every real row).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = seq.to(tl.int64)
    q_lo = tl.load(query_start_loc_ptr + seq)
    q_hi = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if PDL:  # the step's inputs are older than the previous kernel; q, k, v are its output
        gdc_wait()
        gdc_launch_dependents()
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    q_row = q_ptr + token * stride_q_t + head[:, None] * stride_q_h
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_row + dims[None, :], mask=q_mask, other=0.0)
    # RoPE (rotate-half) on full rows: x * cos + sign * swap_halves(x) * sin, no shuffles.
    swapped = tl.where(dims < HALF, dims + HALF, dims - HALF)
    freq = tl.where(dims < HALF, dims, dims - HALF)
    sign = tl.where(dims < HALF, -1.0, 1.0)
    if ROPE:
        q_sw = tl.load(q_row + swapped[None, :], mask=q_mask, other=0.0)
    if WRITE_KV:
        k_row = k_ptr + token * stride_k_t + kv_head * stride_k_h
        k_new = tl.load(k_row + dims, mask=dim_ok, other=0.0)
        v_new = tl.load(v_ptr + token * stride_v_t + kv_head * stride_v_h + dims, mask=dim_ok,
                        other=0.0)  # fmt: skip
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if ROPE:
            k_sw = tl.load(k_row + swapped, mask=dim_ok, other=0.0)

    if q_hi == q_lo:
        return  # graph padding row: no query token, no partials, no counter
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), min_tiles)
    num_active = tl.cdiv(num_tiles, tiles_per_split)  # same for every split of this sequence
    if split >= num_active:
        return
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    if ROPE:
        pos = (seq_len - 1).to(tl.int64)  # the query's position
        cos = tl.load(cos_ptr + pos * stride_cs + freq, mask=dim_ok, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_cs + freq, mask=dim_ok, other=0.0) * sign
        q = q.to(tl.float32) * cos[None, :] + q_sw.to(tl.float32) * sin[None, :]
        q = q.to(q_ptr.dtype.element_ty)

    # Online softmax state (base 2). A finite initial max keeps fully masked rows NaN-free.
    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    num_cached = seq_len
    if WRITE_KV:
        # The new token is not read from the cache: the split that covers its position starts
        # from it (weight 1 at score s_new), and writes it to the cache for later steps.
        num_cached = seq_len - 1
        if split == num_active - 1:
            if ROPE:
                k_new = k_new.to(tl.float32) * cos + k_sw.to(tl.float32) * sin
                k_new = k_new.to(k_ptr.dtype.element_ty)
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale_log2
            m_i = s_new
            l_i = tl.full([GROUP_PAD], 1.0, tl.float32)
            acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32) + v_new.to(tl.float32)[None, :]
            if slot >= 0:
                dst = (slot // BLOCK_SIZE) * stride_cache_block
                dst += (slot % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
                cache_ty = k_cache_ptr.dtype.element_ty
                tl.store(k_cache_ptr + dst + dims, k_new.to(cache_ty), mask=dim_ok)
                tl.store(v_cache_ptr + dst + dims, v_new.to(cache_ty), mask=dim_ok)

    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < num_cached
        block = tl.load(block_table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_row = block * stride_cache_block + (keys % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
        kv_row += kv_head * HEAD_DIM
        k_t = tl.load(
            k_cache_ptr + kv_row[None, :] + dims[:, None],
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        v = tl.load(  # issued with K, before the first use of either
            v_cache_ptr + kv_row[:, None] + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, k_t) * scale_log2  # [GROUP_PAD, BLOCK_N] fp32
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:  # noqa: SIM114 (constexpr, then run-time)
        _normalise_and_store(acc, l_i, out_ptr, token, head, dims, row_ok, dim_ok, stride_o_t,
                             stride_o_h)  # fmt: skip
    elif num_active == 1:
        _normalise_and_store(acc, l_i, out_ptr, token, head, dims, row_ok, dim_ok, stride_o_t,
                             stride_o_h)  # fmt: skip
    else:
        part_row = (token * NUM_Q_HEADS + head) * NUM_SPLITS + split  # int64 [GROUP_PAD]
        tl.store(
            part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_ok)
        tl.debug_barrier()  # every thread's partial is written before the release below
        counter = counter_ptr + seq * NUM_KV_HEADS + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == num_active - 1:  # the last split of this (sequence, kv head): merge
            # all partials of the group in one [split, head, dim] load
            sp = tl.arange(0, NUM_SPLITS)[:, None]
            g = tl.arange(0, GROUP_P2)[None, :]
            ok = (sp < num_active) & (g < GROUP)
            rows3 = (token * NUM_Q_HEADS + kv_head * GROUP + g) * NUM_SPLITS + sp  # [S, G]
            m = tl.load(part_ml_ptr + rows3 * 2, mask=ok, other=-1.0e30, cache_modifier=".cg")
            l = tl.load(part_ml_ptr + rows3 * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            d3 = dims[None, None, :]
            part = tl.load(
                part_acc_ptr + rows3[:, :, None] * HEAD_DIM + d3,
                mask=ok[:, :, None] & (d3 < HEAD_DIM),
                other=0.0,
                cache_modifier=".cg",
            )  # [S, G, D]
            weight = tl.exp2(m - tl.max(m, 0)[None, :])  # [S, G]; empty splits: l = 0
            total = tl.sum(weight * l, 0)  # [G]
            o = tl.sum(part * weight[:, :, None], 0) / tl.where(total > 0, total, 1.0)[:, None]
            g1 = tl.arange(0, GROUP_P2)
            tl.store(
                out_ptr
                + token * stride_o_t
                + (kv_head * GROUP + g1[:, None]) * stride_o_h
                + dims[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=(g1[:, None] < GROUP) & dim_ok[None, :],
            )
            tl.atomic_xchg(counter, 0)  # ready for the next launch


def compiled_kernels() -> dict[Any, Any]:
    """The decode attention kernel's compiled variants so far, by Triton's specialisation key
    (each a CompiledKernel: `n_regs`, `n_spills`, `metadata.shared`, `metadata.num_warps`), for
    occupancy reports (bench/decode_occupancy.py). Triton 3.x keeps them per device, under
    `device_caches` (a tuple whose first item is the dict) or `cache`."""
    jit = _decode_attention_kernel
    caches = getattr(jit, "device_caches", None) or getattr(jit, "cache", {})
    out: dict[Any, Any] = {}
    for c in caches.values():
        out.update(c[0] if isinstance(c, tuple) else c)
    return out


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def _counters(device: torch.device, need: int) -> torch.Tensor:
    """The zeroed per-device counters (allocated once; the kernel leaves them at 0)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < need:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "decode_attention: split counters first allocated inside a CUDA graph capture; "
                "run the forward once before capturing"
            )
        buf = torch.zeros(max(need, NUM_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _fills_gpu(num_seqs: int, num_kv_heads: int, device: torch.device) -> bool:
    """Do one program per (sequence, kv head) already fill the GPU (the large-batch rule)?"""
    target = TARGET_PROGRAMS_PER_SM * _num_sms(device.index or 0)
    return num_seqs * num_kv_heads >= target


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      device: torch.device) -> tuple[int, int]:  # fmt: skip
    """(splits per (sequence, kv head), keys per tile) from the batch size and the key bound
    (host ints only; graph-safe). Small batches: enough programs to fill the GPU, no more splits
    than max_seq_len has tiles, short 32-key tiles when splitting 16+ ways (H200 sweep: batch 1,
    context 512-2048). Batches that fill the GPU: up to MAX_LONG_SPLITS for long sequences only
    (the kernel's `min_tiles`)."""
    if device.type != "cuda":
        return 1, 64
    if _fills_gpu(num_seqs, num_kv_heads, device):  # only long sequences split (`min_tiles`)
        splits = min(math.ceil(max_seq_len / LONG_SPLIT_KEYS), MAX_LONG_SPLITS)
        return (1 if splits <= 1 else triton.next_power_of_2(splits)), 64
    target = TARGET_PROGRAMS_PER_SM * _num_sms(device.index or 0)
    splits = min(math.ceil(target / (num_seqs * num_kv_heads)), MAX_SPLITS)
    block_n = 32 if splits >= 16 else 64
    splits = min(splits, math.ceil(max_seq_len / block_n))
    return (1 if splits <= 1 else triton.next_power_of_2(splits)), block_n


def decode_attention(
    q: torch.Tensor,  # [T, Hq, D], head_dim contiguous (rotated already unless cos/sin given)
    k: torch.Tensor,  # [T, Hkv, D]: the new keys (used only with slot_mapping)
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # int32 [B+1]; q_b = 1 for real rows, 0 for padding (last)
    seq_lens: torch.Tensor,  # int32 [B]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    max_seq_len: int,  # >= every seq_lens[b] (a bucket bound is fine); caps the split count
    scale: float,
    cos: torch.Tensor | None = None,  # fp32 [max_positions, D // 2]: rotate q and the new k
    sin: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,  # int [T]: k/v are new (not in the cache): attend
    # to them from registers and write them there; None: the cache holds every key already
    out: torch.Tensor | None = None,  # [T, Hq, D]
    num_splits: int = 0,  # 0 = choose; else a power of two
    block_n: int = 0,  # keys per tile, a power of two >= 16; 0 = choose
    num_warps: int = 4,
    min_tiles: int = 0,  # tiles a split takes at least; 0 = choose (large batches: long only)
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert cache_dim == head_dim and num_q_heads % num_kv_heads == 0, "q does not match cache"
    assert head_dim % 2 == 0, "RoPE halves"
    assert k_cache.stride()[1:] == (num_kv_heads * head_dim, head_dim, 1), "cache rows"
    assert v_cache.stride() == k_cache.stride(), "k and v caches must share strides"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert block_tables.stride(1) == 1
    rope = cos is not None
    assert not rope or (sin is not None and cos.stride(1) == 1)
    assert not rope or cos.stride() == sin.stride()
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    if num_splits <= 0:
        num_splits, auto_block_n = decode_num_splits(num_seqs, num_kv_heads, max_seq_len,
                                                     q.device)  # fmt: skip
        block_n = block_n or auto_block_n
    block_n = block_n or 64
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    if num_splits > 1:
        rows = num_tokens * num_q_heads * num_splits
        part_acc = torch.empty((rows, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((rows, 2), dtype=torch.float32, device=q.device)
        counters = _counters(q.device, num_seqs * num_kv_heads)
    else:
        part_acc = part_ml = counters = out  # unused
    half = head_dim // 2
    use_pdl = pdl.enabled(q)
    if min_tiles <= 0:
        large = q.device.type == "cuda" and _fills_gpu(num_seqs, num_kv_heads, q.device)
        min_tiles = max(1, LONG_SPLIT_KEYS // block_n) if large else 1
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k,
        v,
        cos if rope else out,
        sin if rope else out,
        slot_mapping if slot_mapping is not None else seq_lens,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_ml,
        counters,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        min_tiles,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0) if rope else 0,
        block_tables.stride(0),
        k_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        HALF=half,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        ROPE=rope,
        WRITE_KV=slot_mapping is not None,
        PDL=use_pdl,
        num_warps=num_warps,
        **pdl.launch_options(use_pdl),
    )
    return out
