"""Loading Hugging Face checkpoint folders: logits vs a dense float64 Llama on the same weights,
and one clear error for a checkpoint that does not match its config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bubblesim.core.models import ModelSpec
from engine.attention import AttentionMetadata
from engine.loader import CheckpointError, load_checkpoint
from engine.model import allocate_kv_cache

try:
    from tests.test_model import dense_llama_logits, rel_err
except ImportError:  # tests/ on sys.path, not the repo root
    from test_model import dense_llama_logits, rel_err

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    w = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": 1 + rnd(h)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w |= {
            p + "input_layernorm.weight": 1 + rnd(h),
            p + "post_attention_layernorm.weight": 1 + rnd(h),
            p + "self_attn.q_proj.weight": rnd(h, h),
            p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h),
            p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(i, h),
            p + "mlp.up_proj.weight": rnd(i, h),
            p + "mlp.down_proj.weight": rnd(h, i),
        }
    return w


def write_checkpoint(folder: Path, cfg: dict, weights: dict[str, torch.Tensor], shards: int = 1):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n].contiguous() for n in names}, folder / "model.safetensors")
        return
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: weights[n].contiguous() for n in part}, folder / fname)
        weight_map |= {n: fname for n in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def paged_logits(model, ids: list[int]) -> torch.Tensor:
    """A prefill of the first half, then one-token decodes, on a shuffled block table."""
    bs, table = 4, [5, 2, 7, 0, 3, 1, 6, 4][: -(-len(ids) // 4)]
    cache = allocate_kv_cache(model.spec, 8, bs, model.dtype, model.device)
    half, out = len(ids) // 2, []
    for lo, hi in [(0, half)] + [(p, p + 1) for p in range(half, len(ids))]:
        attn = AttentionMetadata.from_lists([hi - lo], [hi], [table], bs)
        hidden = model(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), attn, cache)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


@pytest.mark.parametrize("shards,tied", [(1, False), (3, False), (2, True)])
def test_loaded_logits_match_dense_reference(tmp_path, shards, tied):
    cfg = {**CONFIG, "tie_word_embeddings": tied}
    weights = random_weights(cfg, seed=shards)
    write_checkpoint(tmp_path / "ckpt", cfg, weights, shards)
    model = load_checkpoint(tmp_path / "ckpt", torch.float32, "cpu")
    assert model.spec == ModelSpec.from_hf_config(tmp_path / "ckpt" / "config.json", name="ckpt")
    ids = torch.randint(0, cfg["vocab_size"], (13,), generator=torch.Generator().manual_seed(1))
    ref = dense_llama_logits({n: t.double() for n, t in weights.items()}, model.spec, ids.tolist())
    assert rel_err(paged_logits(model, ids.tolist()), ref) < 1e-5


def test_bf16_checkpoint_and_ignored_rotary_buffers(tmp_path):
    weights = {n: t.bfloat16() for n, t in random_weights(CONFIG).items()}
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    write_checkpoint(tmp_path / "ckpt", CONFIG, weights)
    model = load_checkpoint(tmp_path / "ckpt", torch.float32, "cpu")
    assert torch.equal(model.embed_tokens, weights["model.embed_tokens.weight"].float())
    k = model.layers[1].self_attn.qkv_proj[32:48]
    assert torch.equal(k, weights["model.layers.1.self_attn.k_proj.weight"].float())


def _broken(tmp_path: Path, edit, shards: int = 1) -> Path:
    weights = random_weights(CONFIG)
    edit(weights)
    write_checkpoint(tmp_path / "ckpt", CONFIG, weights, shards)
    return tmp_path / "ckpt"


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda w: w.pop("model.layers.1.mlp.up_proj.weight"),
         "tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
        (lambda w: w.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 32)}),
         r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \[32, 32\], "
         r"config.json implies \[16, 32\]"),
        (lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}),
         "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"),
        (lambda w: w.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(48, 32)}),
         "unexpected tensor 'model.layers.2.mlp.up_proj.weight'"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("shards", [1, 2])
def test_mismatched_checkpoint_is_refused_naming_the_tensor(tmp_path, edit, message, shards):
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(_broken(tmp_path, edit, shards), torch.float32, "cpu")


def test_bad_folders_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError, match=r"no \*.safetensors"):
        load_checkpoint(tmp_path, torch.float32, "cpu")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is mapped to missing file"):
        load_checkpoint(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="missing key 'num_attention_heads'"):
        load_checkpoint(tmp_path, torch.float32, "cpu")
