"""The slice of every weight a tensor-parallel rank holds (rank r of n).

Column-parallel (output rows split): q, k, v (whole heads: rank r holds query heads
[r * H / n, (r + 1) * H / n) and KV heads likewise), gate and up. Row-parallel (input columns
split, outputs summed by an all-reduce): o_proj and down_proj. Vocab-parallel: embedding and LM
head rows [r * Vr, (r + 1) * Vr) with Vr = ceil(V / n); the last rank's rows past V are zeros
(never a token: the gathered logits are cut back to V). Norm weights are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bubblesim.core.models import ModelSpec


@dataclass(frozen=True)
class Piece:
    """Rank r's part of one full (Hugging Face) tensor: `length` indices from `start` along
    `dim` (0: rows, 1: columns), stored from row `dst_row` of the local parameter."""

    dst_row: int
    dim: int
    start: int
    length: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(self.dim, self.start, self.length)


def check_divisible(spec: ModelSpec, tp: int) -> None:
    """Raise ValueError (one line) when the model's heads or MLP width do not split into tp."""
    for what, n in (
        ("num_kv_heads", spec.num_kv_heads),
        ("num_heads", spec.num_heads),
        ("intermediate_size", spec.intermediate_size),
    ):
        if n % tp:
            raise ValueError(
                f"config key 'tensor_parallel_size': {tp} does not divide model "
                f"'{spec.name}' {what} {n} (each rank holds whole heads and an equal MLP slice)"
            )


def local_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The shapes one rank computes with: heads and MLP width / tp (hidden size, vocab whole)."""
    if tp == 1:
        return spec
    check_divisible(spec, tp)
    return replace(
        spec,
        num_heads=spec.num_heads // tp,
        num_kv_heads=spec.num_kv_heads // tp,
        intermediate_size=spec.intermediate_size // tp,
    )


def vocab_rows(vocab: int, tp: int) -> int:
    """Embedding / LM head rows per rank: ceil(vocab / tp)."""
    return -(-vocab // tp)


def hf_pieces(spec: ModelSpec, rank: int, tp: int) -> dict[str, tuple[str, Piece]]:
    """HF tensor name (a layer's names with prefix 'model.layers.{i}.' left out) -> (local
    parameter name, as `LlamaModel.named_parameters` has it with 'layers.{i}.' left out, Piece).
    Norm weights are absent (whole everywhere)."""
    q, kv, inter = spec.q_size // tp, spec.kv_size // tp, spec.intermediate_size // tp
    vr = vocab_rows(spec.vocab_size, tp)
    v0 = min(rank * vr, spec.vocab_size)
    vocab = Piece(0, 0, v0, min(vr, spec.vocab_size - v0))
    return {
        "model.embed_tokens.weight": ("embed_tokens", vocab),
        "lm_head.weight": ("lm_head", vocab),
        "self_attn.q_proj.weight": ("self_attn.qkv_proj", Piece(0, 0, rank * q, q)),
        "self_attn.k_proj.weight": ("self_attn.qkv_proj", Piece(q, 0, rank * kv, kv)),
        "self_attn.v_proj.weight": ("self_attn.qkv_proj", Piece(q + kv, 0, rank * kv, kv)),
        "self_attn.o_proj.weight": ("self_attn.o_proj", Piece(0, 1, rank * q, q)),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj", Piece(0, 0, rank * inter, inter)),
        "mlp.up_proj.weight": ("mlp.gate_up_proj", Piece(inter, 0, rank * inter, inter)),
        "mlp.down_proj.weight": ("mlp.down_proj", Piece(0, 1, rank * inter, inter)),
    }


def fused_parts(spec: ModelSpec) -> dict[str, list[tuple[str, int, int]]]:
    """Local parameter name -> the HF tensors fused in it: (HF name, first row in the full fused
    tensor, rows). Unfused parameters map to themselves."""
    q, kv, inter, h = spec.q_size, spec.kv_size, spec.intermediate_size, spec.hidden_size
    return {
        "self_attn.qkv_proj": [
            ("self_attn.q_proj.weight", 0, q),
            ("self_attn.k_proj.weight", q, kv),
            ("self_attn.v_proj.weight", q + kv, kv),
        ],
        "self_attn.o_proj": [("self_attn.o_proj.weight", 0, h)],
        "mlp.gate_up_proj": [
            ("mlp.gate_proj.weight", 0, inter),
            ("mlp.up_proj.weight", inter, inter),
        ],
        "mlp.down_proj": [("mlp.down_proj.weight", 0, h)],
        "embed_tokens": [("model.embed_tokens.weight", 0, spec.vocab_size)],
        "lm_head": [("lm_head.weight", 0, spec.vocab_size)],
    }


def layer_key(name: str) -> str:
    """'layers.3.mlp.down_proj' -> 'mlp.down_proj'; other names unchanged."""
    if name.startswith("layers."):
        return name.split(".", 2)[2]
    return name


def full_shape(name: str, spec: ModelSpec) -> tuple[int, ...] | None:
    """The TP = 1 shape of a sharded parameter (None: a norm weight, whole on every rank)."""
    key = layer_key(name)
    parts = fused_parts(spec).get(key)
    if parts is None:
        return None
    rows = sum(n for _, _, n in parts)
    cols = {"self_attn.o_proj": spec.q_size, "mlp.down_proj": spec.intermediate_size}
    return (rows, cols.get(key, spec.hidden_size))


@torch.no_grad()
def fill_shard(local: torch.Tensor, name: str, full: torch.Tensor, spec: ModelSpec, rank: int,
               tp: int) -> None:  # fmt: skip
    """local = rank's slice of the full (TP = 1 layout) parameter `name`; pad rows zeroed."""
    pieces = hf_pieces(spec, rank, tp)
    local.zero_()
    for hf, first, rows in fused_parts(spec)[layer_key(name)]:
        _, piece = pieces[hf]
        src = piece.take(full.narrow(0, first, rows))
        local[piece.dst_row : piece.dst_row + src.shape[0]].copy_(src)
