"""Tensor parallelism, memory: weight shards and KV heads per GPU (bubblesim.core.models), the fit
check
and its one-line answer (bubblesim.core.tpfit), KV blocks per GPU (bubblesim.core.policy.sizing)."""

from __future__ import annotations

import pytest

from bubblesim.core.config import Config
from bubblesim.core.gpus import get_gpu
from bubblesim.core.models import PRESETS, get_model
from bubblesim.core.policy.sizing import ACTIVATION_RESERVE_BYTES, kv_blocks_for_gpu
from bubblesim.core.tpfit import fit_error, fitting_degrees

GB = 1e9


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_tp1_is_the_whole_model(name: str) -> None:
    m = PRESETS[name]
    h, i, v = m.hidden_size, m.intermediate_size, m.vocab_size
    attn = h * (m.q_size + 2 * m.kv_size) + m.q_size * h
    whole = m.num_layers * (attn + 3 * h * i + 2 * h) + v * h * (1 if m.tie_word_embeddings else 2)
    assert m.params_per_rank(1) == m.num_params == whole + h
    assert m.weight_bytes("bfloat16", 1) == 2 * m.num_params
    assert m.kv_bytes_per_token("bfloat16", 1) == 2 * m.num_layers * m.kv_size * 2


def test_llama70b_shards() -> None:
    m = get_model("llama3-70b")
    for tp in (2, 4, 8):
        per = m.weight_bytes("bfloat16", tp)
        # everything splits evenly (the vocabulary too: 128256 = 8 x 16032) but the norms,
        # which every rank holds whole
        norms = (2 * m.num_layers + 1) * m.hidden_size * 2
        assert per * tp == m.weight_bytes("bfloat16") + (tp - 1) * norms
        # 8 KV heads: tp ranks hold 8 / tp each
        assert m.kv_heads_per_rank(tp) == 8 // tp
        assert m.kv_bytes_per_token("bfloat16", tp) * tp == m.kv_bytes_per_token("bfloat16")
    assert m.weight_bytes("bfloat16", 4) / GB == pytest.approx(35.28, abs=0.01)


def test_kv_heads_replicate_past_their_count() -> None:
    tiny = get_model("tiny")  # 4 heads, 2 KV heads
    assert tiny.kv_heads_per_rank(4) == 1  # replicated: each rank keeps one KV head
    assert tiny.kv_bytes_per_token("bfloat16", 4) == tiny.kv_bytes_per_token("bfloat16", 2)
    assert tiny.tp_error(4) is None
    assert "4 attention heads do not split 8 ways" in str(tiny.tp_error(8))


def _cfg(model: str, gpu: str, tp: int) -> Config:
    return Config(model=model, gpu=gpu, tensor_parallel_size=tp)


@pytest.mark.parametrize(
    "model, gpu, fits",
    [
        ("llama3-70b", "h100", (2, 4, 8)),
        ("llama3-70b", "h200", (2, 4, 8)),
        ("llama3-70b", "l40s", (4, 8)),
        ("llama3-8b", "h100", (1, 2, 4, 8)),
        ("tiny", "h100", (1, 2, 4)),
    ],
)
def test_fitting_degrees(model: str, gpu: str, fits: tuple[int, ...]) -> None:
    assert fitting_degrees(_cfg(model, gpu, 1), get_model(model), get_gpu(gpu)) == fits


def test_fit_error_names_the_degree_that_fits() -> None:
    m, h100 = get_model("llama3-70b"), get_gpu("h100")
    assert fit_error(_cfg("llama3-70b", "h100", 4), m, h100) is None
    why = fit_error(_cfg("llama3-70b", "h100", 1), m, h100)
    assert why is not None and "\n" not in why
    assert "does not fit on one h100" in why and "141.1 GB of weights per GPU" in why
    assert why.endswith("it fits at tensor_parallel_size=2")
    why = fit_error(_cfg("llama3-70b", "l40s", 2), m, get_gpu("l40s"))
    assert why is not None and "on 2 x l40s" in why
    assert why.endswith("it fits at tensor_parallel_size=4")
    tiny = fit_error(_cfg("tiny", "h100", 8), get_model("tiny"), h100)
    assert tiny is not None and tiny.endswith("it fits at tensor_parallel_size 1, 2, 4")


def test_fits_nowhere(tmp_path) -> None:
    """A Llama-3.1-405B-shaped checkpoint: 810 GB of bf16 weights, 101 GB per GPU at tp 8."""
    ckpt = tmp_path / "llama-405b"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        '{"vocab_size": 128256, "hidden_size": 16384, "num_hidden_layers": 126, '
        '"num_attention_heads": 128, "num_key_value_heads": 8, "intermediate_size": 53248, '
        '"max_position_embeddings": 131072}'
    )
    m = get_model(str(ckpt))
    cfg = Config(model=str(ckpt), gpu="h100", tensor_parallel_size=8)
    why = fit_error(cfg, m, get_gpu("h100"))
    assert why is not None and why.endswith("it fits at no tensor_parallel_size up to 8")
    assert fitting_degrees(cfg, m, get_gpu("h200")) == (8,)


def test_kv_blocks_per_gpu_grow_with_tp() -> None:
    m, gpu = get_model("llama3-70b"), get_gpu("h100")
    blocks = {tp: kv_blocks_for_gpu(_cfg("llama3-70b", "h100", tp), m, gpu.memory_bytes)
              for tp in (2, 4, 8)}  # fmt: skip
    assert 0 < blocks[2] < blocks[4] < blocks[8]
    cfg = _cfg("llama3-70b", "h100", 4)
    free = gpu.memory_bytes - m.weight_bytes("bfloat16", 4) - ACTIVATION_RESERVE_BYTES
    per_block = m.kv_bytes_per_token("bfloat16", 4) * cfg.block_size
    assert blocks[4] == int(free * cfg.kv_memory_fraction) // per_block
    # one GPU: the formula of before tensor parallelism, unchanged
    m8 = get_model("llama3-8b")
    free1 = gpu.memory_bytes - m8.weight_bytes("bfloat16") - ACTIVATION_RESERVE_BYTES
    want = int(free1 * Config().kv_memory_fraction) // (m8.kv_bytes_per_token() * 16)
    assert kv_blocks_for_gpu(Config(), m8, gpu.memory_bytes) == want
