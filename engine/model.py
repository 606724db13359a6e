"""Llama-family decoder over a flat token batch and a paged KV cache.

forward(input_ids[T], positions[T], attn, kv_cache) -> final-normed hidden [T, hidden];
compute_logits(hidden[n]) -> float32 [n, vocab]. All sequences of a step are concatenated with
no padding (see engine.attention for the batch layout). Weights: `init_random(seed)` or
`engine.loader.load_checkpoint`. The forward reads no tensor values on the host, so with the
"triton" backend it can be captured in a CUDA graph.

Tensor parallelism (`comm`, engine.tp): the model holds rank r's slices (engine.tp.shard) and
computes with `local`, the spec of its heads and MLP width; o_proj's and down_proj's outputs,
and the vocab-parallel embedding's (ids outside the rank's rows masked), are partial sums that
the norm after each sums over ranks (RMSNorm: an all-reduce then the norm, or one fused kernel
with tp_allreduce "fused"), and compute_logits gathers every rank's vocab slice, so every rank
gets whole logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bubblesim.core.config import Config
from bubblesim.core.models import ModelSpec
from engine.attention import AttentionMetadata, PagedAttention
from engine.rope import rope_tables
from engine.tp.shard import fill_shard, full_shape, local_spec, vocab_rows

INIT_STD = 0.02
# Steps of at most this many tokens (decode batches) run their GEMMs through the Triton skinny
# GEMM on the "triton" backend; larger ones through cuBLAS (docs/engine-perf.md).
SKINNY_MAX_ROWS = 4
SKINNY_FUSE_SILU = True  # SiLU * up in the skinny gate_up GEMM's epilogue


def _skinny(kernels, x: torch.Tensor) -> bool:
    """The skinny GEMM for this many rows (host ints only)."""
    return kernels is not None and 0 < x.shape[0] <= SKINNY_MAX_ROWS


def _linear(kernels, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if _skinny(kernels, x) and kernels.skinny_supports(w.shape[1]):
        return kernels.skinny_gemm(x, w)
    return F.linear(x, w)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RotaryEmbedding(nn.Module):
    """Precomputed float32 cos/sin [max_positions, head_dim // 2] of the spec's rope_type
    (engine.rope); rotate-half (HF Llama) form."""

    def __init__(self, spec: ModelSpec, max_positions: int, device: torch.device, kernels=None):
        super().__init__()
        self.kernels = kernels  # engine.kernels for the fused in-place kernel, else None
        cos, sin = rope_tables(spec, max_positions, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated by each token's position, in fp32 (in place with the kernel)."""
        if self.kernels is not None:
            return self.kernels.rope_inplace(x, positions, self.cos, self.sin)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device, kernels=None, comm=None):
        """`comm`: tensor parallelism; `forward`'s x is then a rank's partial sum (module
        docstring), summed over ranks here, before the residual add."""
        super().__init__()
        self.eps = eps
        self.kernels = kernels  # engine.kernels for the fused kernel, else None
        self.comm = comm
        self.weight = _param((size,), dtype, device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, region: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), x summed over the ranks first under tensor
        parallelism (engine.tp.comm.Comm.reduce_norm; `region`: the fused kernel's buffer
        region, engine.kernels.reduce_norm)."""
        if self.comm is None:
            return self.normalize(x, residual)
        return self.comm.reduce_norm(x, residual, region, self)

    def normalize(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the residual stream stays in the model dtype.
        The Triton kernel writes x + residual into `residual` in place."""
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight, x


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, attention: PagedAttention, rotary, dtype, device):
        """`spec`: this rank's heads (engine.tp.shard.local_spec)."""
        super().__init__()
        self.spec = spec
        self.attention = attention
        self.rotary = [rotary]  # shared by all layers; a list keeps it out of the module tree
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = _param((spec.q_size + 2 * spec.kv_size, spec.hidden_size), dtype, device)
        self.o_proj = _param((spec.hidden_size, spec.q_size), dtype, device)

    def forward(self, x, positions, attn: AttentionMetadata, kv_cache: torch.Tensor):
        kernels = self.attention.kernels
        qkv = _linear(kernels, x, self.qkv_proj)  # [T, q | k | v]
        # a rank's partial sum under tensor parallelism: the next norm sums it (RMSNorm)
        return _linear(kernels, self.attend(qkv, positions, attn, kv_cache), self.o_proj)

    def attend(self, qkv, positions, attn: AttentionMetadata, kv_cache) -> torch.Tensor:
        """qkv [T, q | k | v] -> attention output [T, q_size] (RoPE, KV write, attention)."""
        s, rotary = self.spec, self.rotary[0]
        v = qkv[:, s.q_size + s.kv_size :].view(-1, s.num_kv_heads, s.head_dim)
        if rotary.kernels is not None:  # RoPE fused with the KV write (and decode attention)
            q = qkv[:, : s.q_size].view(-1, s.num_heads, s.head_dim)
            k = qkv[:, s.q_size : s.q_size + s.kv_size].view(-1, s.num_kv_heads, s.head_dim)
            o = self.attention.rope_and_attend(
                q, k, v, positions, rotary.cos, rotary.sin, kv_cache, attn, self.scale
            )
        else:
            qk = qkv[:, : s.q_size + s.kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
            q, k = rotary(positions, qk).split([s.num_heads, s.num_kv_heads], dim=1)
            o = self.attention(q, k, v, kv_cache, attn, self.scale)
        return o.reshape(-1, s.q_size)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype, device, kernels=None):
        super().__init__()
        self.kernels = kernels  # engine.kernels for the fused SiLU * up, else None
        self.gate_up_proj = _param((2 * spec.intermediate_size, spec.hidden_size), dtype, device)
        self.down_proj = _param((spec.hidden_size, spec.intermediate_size), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj's output: a rank's partial sum under tensor parallelism (RMSNorm sums it)."""
        k = self.kernels
        if _skinny(k, x) and SKINNY_FUSE_SILU and k.skinny_supports(x.shape[1]):
            act = k.skinny_gemm(x, self.gate_up_proj, silu_mul=True)
            return _linear(k, act, self.down_proj)
        gate_up = _linear(k, x, self.gate_up_proj)
        if k is not None:
            return _linear(k, k.silu_mul(gate_up), self.down_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(
        self, spec: ModelSpec, attention: PagedAttention, rotary, dtype, device, kernels, comm=None
    ):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype, device, kernels, comm)
        self.self_attn = Attention(spec, attention, rotary, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device, kernels, comm)
        self.mlp = MLP(spec, dtype, device, kernels)

    def forward(self, x, residual, positions, attn, kv_cache, region: int = 2):
        """`region`: the fused all-reduce's buffer region of the input norm's sum (0 in the
        first layer, else 2); the post-attention norm's takes 1 (engine.kernels.reduce_norm)."""
        x, residual = self.input_layernorm(x, residual, region)
        x = self.self_attn(x, positions, attn, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual, 1)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Parameters are allocated uninitialised on `device`; call `init_random` or load weights.

    Parameter names follow HF minus the "model." prefix, with q/k/v fused into
    `self_attn.qkv_proj` ([q; k; v] rows) and gate/up into `mlp.gate_up_proj` ([gate; up]).
    The "triton" attention backend also selects the fused kernels: RMSNorm + residual add, RoPE +
    KV write (+ attention for all-decode batches), SiLU * up."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        attn_backend: str | None = None,
        max_positions: int | None = None,
        comm=None,
    ):
        """`comm` (engine.tp.comm.Comm): this rank's slices of a tensor-parallel model."""
        super().__init__()
        device = torch.device(device)
        self.spec, self.dtype, self.device = spec, dtype, device
        self.comm = comm
        tp, rank = (1, 0) if comm is None else (comm.size, comm.rank)
        self.local = local_spec(spec, tp)  # the heads and MLP width this rank computes
        self.vocab_rows = vocab_rows(spec.vocab_size, tp)  # embedding / LM head rows here
        self.vocab_start = rank * self.vocab_rows
        self.attention = PagedAttention(attn_backend, device)
        kernels = self.kernels = self.attention.kernels
        self.rotary = RotaryEmbedding(spec, max_positions or spec.max_context, device, kernels)
        self.embed_tokens = _param((self.vocab_rows, spec.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(self.local, self.attention, self.rotary, dtype, device, kernels, comm)
            for _ in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, kernels, comm)
        if spec.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _param((self.vocab_rows, spec.hidden_size), dtype, device)

    @property
    def attn_backend(self) -> str:
        return self.attention.backend

    @torch.no_grad()
    def init_random(self, seed: int) -> LlamaModel:
        """Seeded weights generated on the device: N(0, 0.02), output projections scaled by
        1/sqrt(2 * num_layers) so the residual stream stays O(1) over many layers; norms = 1.
        A tensor-parallel rank draws each whole (TP = 1) tensor from the same generator and
        keeps its slice, so every TP degree computes with the TP = 1 weights."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        out_std = INIT_STD / math.sqrt(2 * self.spec.num_layers)
        tp, rank = (1, 0) if self.comm is None else (self.comm.size, self.comm.rank)
        for name, p in self.named_parameters():  # registration order: deterministic
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = out_std if name.endswith(("o_proj", "down_proj")) else INIT_STD
            shape = full_shape(name, self.spec)
            if tp == 1 or shape is None:
                p.normal_(0.0, std, generator=gen)
                continue
            full = torch.empty(shape, dtype=p.dtype, device=p.device)
            full.normal_(0.0, std, generator=gen)
            fill_shard(p, name, full, self.spec, rank, tp)
            del full
        return self

    def forward(
        self,
        input_ids: torch.Tensor,  # int [T]
        positions: torch.Tensor,  # int [T]
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, Hkv, D]
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        # the fused all-reduce's regions (engine.kernels.reduce_norm): the forward's sums take
        # 0, 1, then 2, 1, 2, 1, ..., 2, so no region serves two calls in a row, within a
        # forward or across two
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, attn, kv_cache[i], 2 if i else 0)
        return self.norm(x, residual, 2 if self.layers else 0)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows [T, hidden]; tensor-parallel: this rank's vocab rows, zero elsewhere
        (a partial sum: the first layer's input norm sums it)."""
        if self.comm is None:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return x.masked_fill(outside[:, None], 0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (already final-normed by forward) -> float32 logits [n, vocab]
        (tensor-parallel: gathered from every rank's vocab slice, on every rank)."""
        if _skinny(self.kernels, hidden) and self.kernels.skinny_supports(hidden.shape[1]):
            # fp32 straight from the accumulator: no separate .float() launch
            logits = self.kernels.skinny_gemm(hidden, self.lm_head, out_dtype=torch.float32)
        else:
            logits = F.linear(hidden, self.lm_head).float()
        if self.comm is None:
            return logits
        return self.comm.gather_vocab(logits, self.spec.vocab_size)


def kv_cache_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Of one rank: pass a tensor-parallel model's `local` spec."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.kv_size * elem


def allocate_kv_cache(
    spec: ModelSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zero-filled."""
    shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def engine_dtype(cfg: Config) -> torch.dtype:
    """The config's dtype on CUDA; float32 on CPU (CPU bf16 matmuls are slow and inexact)."""
    return getattr(torch, cfg.dtype) if cfg.device == "cuda" else torch.float32
