"""Parity with Hugging Face transformers on tiny random Llama checkpoints it saved itself, for every
RoPE type the engine supports, in both config layouts (`rope_parameters` as transformers 5 writes
it, and the older `rope_scaling` + top-level `rope_theta`), tied embeddings and a head_dim that is
not hidden / heads.

Per checkpoint: float32 logits within 1e-4 of transformers (prompt logits from one forward, and
each of 16 greedy decode steps from `generate`), and the engine's own greedy run (Engine on CPU)
emits the same 16 tokens. The positions reach past each type's scaling threshold: the same
logits with plain RoPE differ by far more than the tolerance (checked in each case), so a wrong
table cannot pass. Dynamic (NTK) scaling grows only in the decode steps here (prompt within
max_position_embeddings, generation past it): the case engine.rope matches exactly. Needs the
`hf` extra (transformers >= 5); skipped without it.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from bubblesim.core.config import Config  # noqa: E402
from engine.attention import AttentionMetadata  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.loader import load_checkpoint  # noqa: E402
from engine.model import allocate_kv_cache  # noqa: E402
from engine.requests import RequestInput  # noqa: E402

PROMPT_LEN, NEW_TOKENS, MAX_MODEL_LEN = 24, 16, 64
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu" if INTERPRET else None
TOL = 1e-4
BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# name -> (rope dict (rope_theta THETA unless given), other config overrides). Scaling starts at 16
# (llama3, yarn) or at max_position_embeddings = 32 (dynamic); the 40 positions run past both.
CASES: dict[str, tuple[dict, dict]] = {
    "default": ({"rope_type": "default"}, {}),
    "linear": ({"rope_type": "linear", "factor": 2.5}, {}),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, {"max_position_embeddings": 32}),
    "llama3": (
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
        {},
    ),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, {}),
    # theta 100 and original 475 put yarn's ramp inside the 8 frequencies (dims ~2.7 .. 6.3 with
    # these betas; 1.5 .. 7.5 with the defaults), so betas and truncate change the table
    "yarn-mscale": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 475,
         "rope_theta": 100.0, "mscale": 0.9, "mscale_all_dim": 0.4, "beta_fast": 16.0,
         "beta_slow": 2.0},
        {"max_position_embeddings": 1900},
    ),
    "yarn-attention-factor": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 475,
         "rope_theta": 100.0, "attention_factor": 1.25, "truncate": False},
        {"max_position_embeddings": 1900},
    ),
    "tied-llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
         "original_max_position_embeddings": 16},
        {"tie_word_embeddings": True},
    ),
    "head-dim-24-linear": ({"rope_type": "linear", "factor": 2.0}, {"head_dim": 24}),
}  # fmt: skip
THETA = 5000.0


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def save_hf_checkpoint(folder: Path, rope: dict, overrides: dict, seed: int = 0) -> None:
    """A LlamaForCausalLM saved by transformers, weights large enough (std 0.1) that positions
    visibly change the logits."""
    cfg = transformers.LlamaConfig(
        **(BASE | overrides), rope_parameters={"rope_theta": THETA, **rope}
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)


def to_old_layout(folder: Path) -> None:
    """Rewrite config.json as older transformers wrote it: `rope_scaling` (null when unscaled, the
    type under `type`) and a top-level `rope_theta`."""
    cfg = json.loads((folder / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    assert "rope_scaling" not in cfg
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope["rope_type"] == "default":
        cfg["rope_scaling"] = None
    else:
        rope["type"] = rope.pop("rope_type")
        cfg["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(cfg))


def engine_logits(model, ids: list[int], prefill_len: int) -> torch.Tensor:
    """[len(ids), vocab]: one prefill of ids[:prefill_len], then one-token decodes."""
    bs = 16
    table, dev = list(range(-(-len(ids) // bs))), model.device
    cache = allocate_kv_cache(model.spec, len(table), bs, model.dtype, dev)
    out = []
    steps = [(0, prefill_len)] + [(p, p + 1) for p in range(prefill_len, len(ids))]
    with torch.no_grad():
        for lo, hi in steps:
            attn = AttentionMetadata.from_lists([hi - lo], [hi], [table], bs, dev)
            ids_t, pos = torch.tensor(ids[lo:hi], device=dev), torch.arange(lo, hi, device=dev)
            hidden = model(ids_t, pos, attn, cache)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def hf_reference(folder: Path, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (N tokens after the P-token prompt) and its logits at
    positions 0 .. P + N - 2: [P + N - 1, vocab]."""
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # exactly NEW_TOKENS tokens, like the engine
    ids = torch.tensor([prompt])
    with torch.no_grad():
        prompt_logits = hf(ids).logits[0]  # one forward, as the engine's prefill
        gen = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = gen.sequences[0, PROMPT_LEN:].tolist()
    decode_logits = torch.cat([step[0:1] for step in gen.logits[1:]])  # positions P .. P + N - 2
    return tokens, torch.cat([prompt_logits, decode_logits]).float()


def plain_rope_logits(folder: Path, ids: list[int], theta: float) -> torch.Tensor:
    """transformers' logits for the same weights with plain RoPE (one forward over all ids)."""
    plain = {"rope_type": "default", "rope_theta": theta}
    hf = transformers.LlamaForCausalLM.from_pretrained(
        folder, dtype=torch.float32, rope_parameters=plain
    ).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def engine_greedy(folder: Path, prompt: list[int]) -> list[int]:
    cfg = Config(
        model=str(folder), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
        max_num_seqs=2, max_num_batched_tokens=64, cuda_graphs=False, gc_freeze=False,
    )  # fmt: skip
    req = RequestInput(0, PROMPT_LEN, NEW_TOKENS, prompt_ids=prompt)
    return list(Engine(cfg).run([req], arrival="asap")[0].token_ids)


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_matches_transformers(tmp_path, case, layout):
    rope, overrides = CASES[case]
    folder = tmp_path / case
    save_hf_checkpoint(folder, rope, overrides)
    written = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in written  # transformers 5 writes the current layout
    if layout == "rope_scaling":
        to_old_layout(folder)
    prompt = torch.randint(0, BASE["vocab_size"], (PROMPT_LEN,), generator=torch.Generator()
                           .manual_seed(7)).tolist()  # fmt: skip
    hf_tokens, hf_logits = hf_reference(folder, prompt)
    ids = prompt + hf_tokens
    model = load_checkpoint(folder, torch.float32, "cpu", max_positions=MAX_MODEL_LEN)
    assert model.spec.rope_type == rope["rope_type"]
    got = engine_logits(model, ids, PROMPT_LEN)[: len(ids) - 1]
    err = (got - hf_logits).abs().max().item()
    assert err < TOL, f"{case}/{layout}: logits differ from transformers by {err:.2e}"
    if rope["rope_type"] != "default":  # the test sees the scaling: plain RoPE is far off
        off = (
            (got - plain_rope_logits(folder, ids, rope.get("rope_theta", THETA))[: len(ids) - 1])
            .abs()
            .max()
            .item()
        )
        assert off > 100 * TOL, f"{case}: plain RoPE is only {off:.2e} away; positions too short"
    assert engine_greedy(folder, prompt) == hf_tokens


@pytest.mark.skipif(TRITON_DEVICE is None, reason="needs CUDA, or TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("case", ["dynamic", "yarn-attention-factor", "head-dim-24-linear"])
def test_triton_kernels_match_transformers(tmp_path, case):
    """The fused kernels (RoPE + KV write in the prefill, RoPE + decode attention in each step)
    read the same tables: dynamic's per-row bases, yarn's scaled cos/sin, a 24-wide head. Run with
    `TRITON_INTERPRET=1` on CPU (about 15 s a case) or on a GPU, where Triton's fp32 dots run in
    TF32: a looser tolerance there, still far below the plain-RoPE gap (> 0.2 in these cases)."""
    rope, overrides = CASES[case]
    save_hf_checkpoint(tmp_path / case, rope, overrides)
    prompt = torch.randint(0, BASE["vocab_size"], (PROMPT_LEN,), generator=torch.Generator()
                           .manual_seed(7)).tolist()  # fmt: skip
    hf_tokens, hf_logits = hf_reference(tmp_path / case, prompt)
    model = load_checkpoint(
        tmp_path / case, torch.float32, TRITON_DEVICE, "triton", max_positions=MAX_MODEL_LEN
    )
    got = engine_logits(model, prompt + hf_tokens, PROMPT_LEN)[: PROMPT_LEN + NEW_TOKENS - 1]
    err = (got.cpu() - hf_logits).abs().max().item()
    assert err < (TOL if TRITON_DEVICE == "cpu" else 2e-2), f"{case}: {err:.2e}"


def test_dynamic_rows_past_max_positions_are_transformers_per_step_frequencies():
    """The dynamic table's row p >= max_position_embeddings is transformers' NTK frequencies for
    seq_len p + 1 (what a one-token decode step at p uses), and rows below are plain RoPE."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from bubblesim.core.models import ModelSpec
    from engine.rope import rope_tables

    cfg = transformers.LlamaConfig(
        **(BASE | {"max_position_embeddings": 32}),
        rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": THETA},
    )
    spec = ModelSpec(
        name="t", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, max_context=32, rope_theta=THETA,
        rope_type="dynamic", rope_scaling_factor=3.0, rope_original_max_context=32,
    )  # fmt: skip
    cos, sin = rope_tables(spec, 100, torch.device("cpu"))
    for p in (0, 17, 31, 32, 33, 64, 99):
        inv_freq, scale = ROPE_INIT_FUNCTIONS["dynamic"](copy.deepcopy(cfg), "cpu", seq_len=p + 1)
        angle = p * inv_freq.double()
        assert torch.allclose(cos[p].double(), angle.cos() * scale, atol=2e-5), p
        assert torch.allclose(sin[p].double(), angle.sin() * scale, atol=2e-5), p
