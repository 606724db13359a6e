"""Attention metadata and the paged attention backends ("triton" and "torch").

KV cache layout: one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
(`engine.model.allocate_kv_cache`); layer l uses K = cache[l, 0], V = cache[l, 1], each
[num_blocks, block_size, num_kv_heads, head_dim]. Token slot = block_id * block_size + offset.

A batch is flat: the query tokens of sequence b are query_start_loc[b] .. query_start_loc[b+1]
(q_b tokens), seq_lens[b] counts its context including them, and query i sits at position
seq_lens[b] - q_b + i and attends keys 0..that position. Prefill chunks, decodes (q_b = 1) and
k+1 verification mix freely in one batch.

The "torch" backend is a vectorised PyTorch reference (the CPU backend of the engine and the
tests' oracle). It reads no tensor values on the host except in its KV write, which uses boolean
indexing (a sync on CUDA), so only the "triton" backend may run inside a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BACKENDS = ("triton", "torch")


@dataclass
class AttentionMetadata:
    """Per-step attention inputs; the engine may preallocate the tensors and refill them in place
    (sizes the host needs are the two ints, which may be bucket upper bounds)."""

    query_start_loc: torch.Tensor  # int32 [B+1], query_start_loc[0] = 0
    seq_lens: torch.Tensor  # int32 [B], context incl. this step's tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks], physical block ids
    slot_mapping: torch.Tensor  # int64 (or int32) [T]; slot of each new token, -1 = skip
    max_query_len: int  # >= every q_b; sizes the kernel grid
    max_seq_len: int  # >= every seq_lens[b]
    num_kv_splits: int = 0  # triton split-KV; 0 = choose from the sizes above
    # triton: the flat grid (engine.kernels.paged_attention), fixed by the token count and the
    # number of sequence rows: the sizes above are a mixed-step CUDA graph's bucket bounds
    flat_grid: bool = False

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @staticmethod
    def from_lists(
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        num_tokens: int | None = None,
    ) -> AttentionMetadata:
        """Build from Python lists (tests; eager engine paths). `num_tokens` > sum(query_lens)
        pads the slot mapping with -1."""
        assert len(query_lens) == len(seq_lens) == len(block_tables)
        starts = [0]
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            assert 1 <= q_len <= s_len <= len(table) * block_size, (q_len, s_len, len(table))
            starts.append(starts[-1] + q_len)
            slots += [
                table[p // block_size] * block_size + p % block_size
                for p in range(s_len - q_len, s_len)
            ]
        slots += [-1] * ((num_tokens or len(slots)) - len(slots))
        width = max((len(t) for t in block_tables), default=1)
        rows = [list(t) + [0] * (width - len(t)) for t in block_tables]

        def i32(x: object) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32, device=device)

        return AttentionMetadata(
            query_start_loc=i32(starts),
            seq_lens=i32(list(seq_lens)),
            block_tables=i32(rows).reshape(len(rows), width),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=1),
            max_seq_len=max(seq_lens, default=1),
        )


def default_backend(device: torch.device | str) -> str:
    return "triton" if torch.device(device).type == "cuda" else "torch"


def check_backend(name: str | None, device: torch.device | str) -> str:
    """The backend to use: `name`, or the default for the device; one clear error otherwise."""
    name = name or default_backend(device)
    if name not in BACKENDS:
        raise ValueError(f"attention backend '{name}': must be one of {BACKENDS}")
    if name == "triton" and torch.device(device).type == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention backend 'triton' on CPU needs TRITON_INTERPRET=1")
    return name


# ---- torch reference backend ------------------------------------------------------------------


def write_kv_cache_torch(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T], < 0 = skip
) -> None:
    slots = slot_mapping.long()
    keep = slots >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slots[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots[keep]] = v[keep].to(v_cache.dtype)


def _token_positions(attn: AttentionMetadata, num_tokens: int, device: torch.device):
    """Per token: its sequence (clamped), its position, whether it belongs to a sequence."""
    starts = attn.query_start_loc.long()
    tokens = torch.arange(num_tokens, device=device)
    seq = torch.searchsorted(starts[1:], tokens, right=True)
    valid = seq < attn.num_seqs
    seq = seq.clamp(max=max(attn.num_seqs - 1, 0))
    q_lens = starts[1:] - starts[:-1]
    pos = attn.seq_lens.long()[seq] - q_lens[seq] + (tokens - starts[seq])
    return seq, pos, valid


def paged_attention_torch(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    max_chunk_elems: int = 1 << 24,
) -> torch.Tensor:
    """Each token gathers keys 0..max_seq_len-1 of its sequence (masked past its position);
    tokens are processed in chunks so the gathered K/V stay under `max_chunk_elems`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    if attn.num_seqs == 0:
        return out.zero_()
    seq, pos, valid = _token_positions(attn, num_tokens, q.device)
    keys = torch.arange(max(attn.max_seq_len, 1), device=q.device)
    max_blocks = attn.block_tables.shape[1]
    table_col = (keys // block_size).clamp(max=max_blocks - 1)
    tables = attn.block_tables.long()
    k_flat = k_cache.reshape(-1, num_kv_heads, head_dim)
    v_flat = v_cache.reshape(-1, num_kv_heads, head_dim)
    chunk = max(1, max_chunk_elems // (keys.numel() * num_kv_heads * head_dim))
    for lo in range(0, num_tokens, chunk):
        hi = min(lo + chunk, num_tokens)
        blocks = tables[seq[lo:hi]][:, table_col]  # [t, S]
        mask = (keys[None, :] <= pos[lo:hi, None]) & valid[lo:hi, None]  # [t, S]
        slots = blocks.clamp(0, num_blocks - 1) * block_size + keys % block_size
        slots = torch.where(mask, slots, 0)
        zero = torch.zeros((), dtype=compute, device=q.device)
        k = torch.where(mask[..., None, None], k_flat[slots].to(compute), zero)  # [t,S,Hkv,D]
        v = torch.where(mask[..., None, None], v_flat[slots].to(compute), zero)
        qc = q[lo:hi].to(compute).view(hi - lo, num_kv_heads, group, head_dim)
        scores = torch.einsum("tkgd,tskd->tkgs", qc, k) * scale
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows of padding tokens: all -inf
        o = torch.einsum("tkgs,tskd->tkgd", probs, v)
        out[lo:hi] = o.reshape(hi - lo, num_q_heads, head_dim).to(out.dtype)
    return out


# ---- the layer-facing entry point -------------------------------------------------------------


class PagedAttention:
    """Writes this step's K/V into the layer's cache, then attends. One per model."""

    def __init__(self, backend: str | None, device: torch.device | str):
        self.backend = check_backend(backend, device)
        self.kernels = None  # the engine.kernels module with the "triton" backend
        if self.backend == "triton":
            from engine import kernels

            self.kernels = kernels

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if self.backend == "torch":
            write_kv_cache_torch(k, v, k_cache, v_cache, attn.slot_mapping)
            return paged_attention_torch(q, k_cache, v_cache, attn, scale)
        if attn.max_query_len == 1:  # all decodes: the KV write is fused into the attention
            return self._decode(q, k, v, k_cache, v_cache, attn, scale)
        self.kernels.write_kv_cache(k, v, k_cache, v_cache, attn.slot_mapping)
        return self._attend(q, k_cache, v_cache, attn, scale)

    def rope_and_attend(
        self,
        q: torch.Tensor,  # [T, Hq, D] before RoPE (a view of qkv; may be rotated in place)
        k: torch.Tensor,  # [T, Hkv, D] before RoPE
        v: torch.Tensor,
        positions: torch.Tensor,  # int [T]
        cos: torch.Tensor,  # fp32 [max_positions, D // 2] (engine.model.RotaryEmbedding)
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """ "triton" backend: RoPE, KV write and attention in 2 launches (1 for all decodes)."""
        assert self.kernels is not None, "rope_and_attend needs the triton backend"
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if attn.max_query_len == 1:
            return self._decode(q, k, v, k_cache, v_cache, attn, scale, cos, sin)
        self.kernels.rope_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache,
                                   attn.slot_mapping)  # fmt: skip
        return self._attend(q, k_cache, v_cache, attn, scale)

    def _decode(self, q, k, v, k_cache, v_cache, attn, scale, cos=None, sin=None):
        """All decodes: one launch (RoPE at position seq_len - 1, which `positions` equals)."""
        return self.kernels.decode_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            attn.query_start_loc,
            attn.seq_lens,
            attn.block_tables,
            attn.max_seq_len,
            scale,
            cos=cos,
            sin=sin,
            slot_mapping=attn.slot_mapping,
            num_splits=attn.num_kv_splits,
        )

    def _attend(self, q, k_cache, v_cache, attn, scale):
        return self.kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            attn.query_start_loc,
            attn.seq_lens,
            attn.block_tables,
            attn.max_query_len,
            attn.max_seq_len,
            scale,
            num_splits=attn.num_kv_splits,
            flat=attn.flat_grid,
        )
