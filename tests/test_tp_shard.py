"""Which slice of every weight a tensor-parallel rank holds (engine.tp.shard): the ranks' slices
put together are the whole tensor, vocab rows past the vocabulary are zero, and a model that
does not split is refused with one line. Pure tensor work: no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bubblesim.core.models import PRESETS
from engine.tp.shard import (
    check_divisible,
    fill_shard,
    full_shape,
    hf_pieces,
    local_spec,
    vocab_rows,
)

SPEC = PRESETS["small"]  # 8 query heads, 4 KV heads, head_dim 32, MLP 768, vocab 4096


def shards(name: str, full: torch.Tensor, tp: int, spec=SPEC) -> list[torch.Tensor]:
    loc = local_spec(spec, tp)
    out = []
    for r in range(tp):
        shape = _local_shape(name, loc, spec, tp)
        t = torch.full(shape, float("nan"))
        fill_shard(t, name, full, spec, r, tp)
        out.append(t)
    return out


def _local_shape(name: str, loc, spec, tp: int) -> tuple[int, int]:
    h = spec.hidden_size
    return {
        "layers.0.self_attn.qkv_proj": (loc.q_size + 2 * loc.kv_size, h),
        "layers.0.self_attn.o_proj": (h, loc.q_size),
        "layers.0.mlp.gate_up_proj": (2 * loc.intermediate_size, h),
        "layers.0.mlp.down_proj": (h, loc.intermediate_size),
        "embed_tokens": (vocab_rows(spec.vocab_size, tp), h),
    }[name]


@pytest.mark.parametrize("tp", [2, 4])
def test_shards_put_together_are_the_whole_tensor(tp: int):
    q, kv, inter = SPEC.q_size, SPEC.kv_size, SPEC.intermediate_size
    ql, kl, il = q // tp, kv // tp, inter // tp
    g = torch.Generator().manual_seed(0)
    for name in ("layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj",
                 "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"):  # fmt: skip
        shape = full_shape(name, SPEC)
        assert shape is not None
        full = torch.randn(shape, generator=g)
        parts = shards(name, full, tp)
        if name.endswith("qkv_proj"):  # [q_r; k_r; v_r] per rank -> [q; k; v]
            back = torch.cat(
                [torch.cat([p[:ql] for p in parts]), torch.cat([p[ql : ql + kl] for p in parts]),
                 torch.cat([p[ql + kl :] for p in parts])]
            )  # fmt: skip
        elif name.endswith("gate_up_proj"):
            back = torch.cat(
                [torch.cat([p[:il] for p in parts]), torch.cat([p[il:] for p in parts])]
            )
        else:  # row-parallel: input columns split
            back = torch.cat(parts, dim=1)
        assert torch.equal(back, full), name


def test_vocab_rows_past_the_vocabulary_are_zero():
    spec = replace(SPEC, vocab_size=4097)
    full = torch.randn(4097, spec.hidden_size)
    parts = shards("embed_tokens", full, 2, spec)
    assert parts[0].shape[0] == parts[1].shape[0] == 2049
    assert torch.equal(torch.cat(parts)[:4097], full)
    assert (parts[1][-1] == 0).all()
    assert hf_pieces(spec, 1, 2)["lm_head.weight"][1].length == 2048


def test_a_model_that_does_not_split_is_one_line():
    check_divisible(SPEC, 4)
    with pytest.raises(ValueError) as e:
        check_divisible(SPEC, 8)  # 4 KV heads
    assert "\n" not in str(e.value) and "num_kv_heads 4" in str(e.value)
