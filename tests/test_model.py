"""The Llama model on the paged cache vs a plain dense float64 Llama written here (HF semantics).

`dense_llama_logits` and `hf_weights` are also used by test_loader.py; `run_mixed_step` by the
interpreted Triton run in test_kernels.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from bubblesim.core.models import PRESETS, ModelSpec
from engine.attention import AttentionMetadata
from engine.model import LlamaModel, allocate_kv_cache
from engine.rope import rope_inv_freq

# tiny, with Llama-3 RoPE scaling whose bands fall inside this head_dim's frequencies
SPEC = replace(
    PRESETS["tiny"],
    rope_type="llama3",
    rope_scaling_factor=8.0,
    rope_original_max_context=64,
    max_context=256,
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ---- the dense reference -----------------------------------------------------------------------


def hf_weights(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names, unfused, float64 on CPU."""
    s = model.spec
    w = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm.weight}
    if not s.tie_word_embeddings:
        w["lm_head.weight"] = model.lm_head
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.self_attn.qkv_proj.split([s.q_size, s.kv_size, s.kv_size])
        gate, up = layer.mlp.gate_up_proj.chunk(2)
        w |= {
            p + "input_layernorm.weight": layer.input_layernorm.weight,
            p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.self_attn.o_proj,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.mlp.down_proj,
        }
    return {name: t.detach().double().cpu() for name, t in w.items()}


def _inv_freq_reference(s: ModelSpec) -> list[float]:
    """HF `_compute_llama3_parameters`, one frequency at a time."""
    out = []
    for i in range(0, s.head_dim, 2):
        f = 1.0 / s.rope_theta ** (i / s.head_dim)
        if s.rope_type == "llama3":
            old = s.rope_original_max_context
            wavelen = 2 * math.pi / f
            if wavelen > old / s.rope_low_freq_factor:
                f /= s.rope_scaling_factor
            elif wavelen >= old / s.rope_high_freq_factor:
                lo, hi = s.rope_low_freq_factor, s.rope_high_freq_factor
                smooth = (old / wavelen - lo) / (hi - lo)
                f = (1 - smooth) * f / s.rope_scaling_factor + smooth * f
        out.append(f)
    return out


def dense_llama_logits(w: dict[str, torch.Tensor], s: ModelSpec, ids: list[int]) -> torch.Tensor:
    """Plain Llama over one whole sequence in float64: logits [len(ids), vocab]."""

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.rms_norm_eps) * weight

    def rotate(x):  # [H, T, D]
        x1, x2 = x[..., : s.head_dim // 2], x[..., s.head_dim // 2 :]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    n = len(ids)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * torch.tensor(_inv_freq_reference(s))
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][ids]
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, s.num_heads, -1).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, s.num_kv_heads, -1).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, s.num_kv_heads, -1).transpose(0, 1)
        rep = s.num_heads // s.num_kv_heads
        q, k = rotate(q), rotate(k).repeat_interleave(rep, 0)
        scores = (q @ k.transpose(1, 2) / math.sqrt(s.head_dim)).masked_fill(~causal, -math.inf)
        o = (scores.softmax(-1) @ v.repeat_interleave(rep, 0)).transpose(0, 1).reshape(n, -1)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


# ---- helpers driving the paged model -----------------------------------------------------------


def token_ids(spec: ModelSpec, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def block_tables_for(lengths: list[int], block_size: int, seed: int = 0) -> list[list[int]]:
    """Disjoint shuffled block ids; returns the tables (total blocks = their sum + 2)."""
    need = [-(-n // block_size) for n in lengths]
    perm = torch.randperm(sum(need) + 2, generator=torch.Generator().manual_seed(seed)).tolist()
    starts = [sum(need[:i]) for i in range(len(need))]
    return [perm[a : a + n] for a, n in zip(starts, need)]


def run_step(model, cache, seqs, chunks, tables, block_size):
    """One flat batch: for each (seq index, start, stop) in `chunks`, tokens start..stop-1."""
    ids, pos = [], []
    for b, lo, hi in chunks:
        ids += seqs[b][lo:hi]
        pos += list(range(lo, hi))
    attn = AttentionMetadata.from_lists(
        [hi - lo for _, lo, hi in chunks],
        [hi for _, _, hi in chunks],
        [tables[b] for b, _, _ in chunks],
        block_size,
        device=model.device,
    )
    as_tensor = torch.tensor
    hidden = model(as_tensor(ids, device=model.device), as_tensor(pos, device=model.device),
                   attn, cache)  # fmt: skip
    return model.compute_logits(hidden)


def run_mixed_step(backend: str, device: str = "cpu", dtype=torch.float32) -> torch.Tensor:
    """Step 1 prefills three sequences (one only partly); step 2 mixes the rest of that prefill
    chunk, a decode and a 3-token verification. Returns step 2's logits."""
    model = LlamaModel(SPEC, dtype, device, attn_backend=backend)
    # the same weights on every device and dtype (generators differ across devices)
    model.load_state_dict(LlamaModel(SPEC, torch.float32, "cpu").init_random(1).state_dict())
    seqs, bs = token_ids(SPEC, [10, 6, 6], seed=1), 4
    tables = block_tables_for([10, 6, 6], bs, seed=1)
    cache = allocate_kv_cache(SPEC, sum(map(len, tables)) + 2, bs, dtype, device)
    run_step(model, cache, seqs, [(0, 0, 6), (1, 0, 5), (2, 0, 3)], tables, bs)
    return run_step(model, cache, seqs, [(0, 6, 10), (1, 5, 6), (2, 3, 6)], tables, bs)


def run_decode_steps(backend: str, device: str = "cpu", dtype=torch.float32) -> torch.Tensor:
    """A prefill of three sequences, then three all-decode steps (one token each): the decode
    steps' logits, stacked."""
    model = LlamaModel(SPEC, dtype, device, attn_backend=backend)
    model.load_state_dict(LlamaModel(SPEC, torch.float32, "cpu").init_random(2).state_dict())
    lengths, bs = [9, 4, 14], 4
    seqs, tables = token_ids(SPEC, lengths, seed=2), block_tables_for(lengths, bs, seed=2)
    cache = allocate_kv_cache(SPEC, sum(map(len, tables)) + 2, bs, dtype, device)
    run_step(model, cache, seqs, [(0, 0, 6), (1, 0, 1), (2, 0, 11)], tables, bs)
    out = []
    for p in range(3):
        chunks = [(0, 6 + p, 7 + p), (1, 1 + p, 2 + p), (2, 11 + p, 12 + p)]
        out.append(run_step(model, cache, seqs, chunks, tables, bs))
    return torch.cat(out)


# ---- tests -------------------------------------------------------------------------------------


def test_rope_inv_freq_matches_hf_formula():
    for spec in (SPEC, PRESETS["llama3-8b"], PRESETS["llama3.2-1b"], PRESETS["tiny"]):
        ref = torch.tensor(_inv_freq_reference(spec), dtype=torch.float64)
        assert torch.allclose(rope_inv_freq(spec), ref, rtol=1e-12, atol=0)
    scaled = rope_inv_freq(SPEC)
    plain = rope_inv_freq(replace(SPEC, rope_type="default", rope_scaling_factor=0))
    assert (scaled < plain).any() and (scaled == plain).any()  # some bands scaled, some not


def test_decode_token_by_token_matches_dense():
    model = LlamaModel(SPEC, torch.float32, "cpu").init_random(0)
    lengths, bs = [9, 5, 12], 4
    seqs, tables = token_ids(SPEC, lengths), block_tables_for(lengths, bs)
    cache = allocate_kv_cache(SPEC, sum(map(len, tables)) + 2, bs, torch.float32, "cpu")
    logits: list[list[torch.Tensor]] = [[] for _ in lengths]
    for p in range(max(lengths)):  # every live sequence decodes one token per step
        live = [b for b, n in enumerate(lengths) if p < n]
        out = run_step(model, cache, seqs, [(b, p, p + 1) for b in live], tables, bs)
        for row, b in enumerate(live):
            logits[b].append(out[row])
    weights = hf_weights(model)
    for b, ids in enumerate(seqs):
        assert rel_err(torch.stack(logits[b]), dense_llama_logits(weights, SPEC, ids)) < 1e-5


def test_mixed_step_matches_dense_and_prefill():
    out = run_mixed_step("torch")
    model = LlamaModel(SPEC, torch.float32, "cpu").init_random(1)
    seqs, weights = token_ids(SPEC, [10, 6, 6], seed=1), hf_weights(model)
    ref = torch.cat([
        dense_llama_logits(weights, SPEC, seqs[0])[6:10],
        dense_llama_logits(weights, SPEC, seqs[1])[5:6],
        dense_llama_logits(weights, SPEC, seqs[2])[3:6],
    ])  # fmt: skip
    assert out.dtype == torch.float32 and out.shape == (8, SPEC.vocab_size)
    assert rel_err(out, ref) < 1e-5


def test_tied_embeddings_and_logits_dtype():
    spec = replace(SPEC, tie_word_embeddings=True)
    model = LlamaModel(spec, torch.bfloat16, "cpu").init_random(0)
    assert model.lm_head is model.embed_tokens
    assert sum(p.numel() for p in model.parameters()) == spec.num_params
    seqs, bs = token_ids(spec, [7]), 4
    cache = allocate_kv_cache(spec, 4, bs, torch.bfloat16, "cpu")
    logits = run_step(model, cache, seqs, [(0, 0, 7)], [[1, 3]], bs)
    assert logits.dtype == torch.float32 and logits.shape == (7, spec.vocab_size)
    ref = dense_llama_logits(hf_weights(model), spec, seqs[0])
    assert rel_err(logits, ref) < 3e-2  # bf16 weights and activations


def test_init_random_is_seeded_and_activations_stay_sane():
    a = LlamaModel(PRESETS["small"], torch.float32, "cpu").init_random(5)
    b = LlamaModel(PRESETS["small"], torch.float32, "cpu").init_random(5)
    c = LlamaModel(PRESETS["small"], torch.float32, "cpu").init_random(6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") or not torch.equal(pa, pc), name
    deep = replace(PRESETS["tiny"], num_layers=32)
    model = LlamaModel(deep, torch.float32, "cpu").init_random(0)
    seqs, bs = token_ids(deep, [16]), 16
    cache = allocate_kv_cache(deep, 2, bs, torch.float32, "cpu")
    logits = run_step(model, cache, seqs, [(0, 0, 16)], [[1]], bs)
    assert logits.isfinite().all() and 0.05 < logits.std().item() < 5.0


def test_forward_reads_no_tensor_values_on_host(monkeypatch):
    model = LlamaModel(SPEC, torch.float32, "cpu").init_random(0)
    seqs, bs = token_ids(SPEC, [6, 3]), 4
    cache = allocate_kv_cache(SPEC, 6, bs, torch.float32, "cpu")
    ids = torch.tensor(seqs[0] + seqs[1])
    pos = torch.tensor(list(range(6)) + list(range(3)))
    attn = AttentionMetadata.from_lists([6, 3], [6, 3], [[4, 0], [2]], bs)

    def forbidden(*_args, **_kw):
        raise AssertionError("host read of a tensor value inside forward")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    hidden = model(ids, pos, attn, cache)
    model.compute_logits(hidden)
    monkeypatch.undo()
    assert hidden.isfinite().all()


def test_backend_selection():
    import os

    assert LlamaModel(SPEC, torch.float32, "cpu").attn_backend == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        LlamaModel(SPEC, torch.float32, "cpu", attn_backend="flash")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            LlamaModel(SPEC, torch.float32, "cpu", attn_backend="triton")


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_triton_backend_matches_dense_bf16():
    out = run_mixed_step("triton", "cuda", torch.bfloat16)
    ref = run_mixed_step("torch", "cpu", torch.float32)
    assert rel_err(out.cpu(), ref) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("skinny_rows", [0, 4])
def test_gpu_triton_decode_steps_match_torch_bf16(monkeypatch, skinny_rows):
    import engine.model

    monkeypatch.setattr(engine.model, "SKINNY_MAX_ROWS", skinny_rows)
    out = run_decode_steps("triton", "cuda", torch.bfloat16)
    ref = run_decode_steps("torch", "cpu", torch.float32)
    assert rel_err(out.cpu(), ref) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("skinny_rows", [0, 8])
def test_gpu_decode_step_replays_in_cuda_graph(monkeypatch, skinny_rows):
    """Capture one decode step with preallocated buffers; replay with new data == eager."""
    import engine.model

    monkeypatch.setattr(engine.model, "SKINNY_MAX_ROWS", skinny_rows)
    spec, bs, batch = PRESETS["small"], 16, 8
    model = LlamaModel(spec, torch.bfloat16, "cuda").init_random(0)
    cache = allocate_kv_cache(spec, 64, bs, torch.bfloat16, "cuda")
    tables = torch.arange(64, dtype=torch.int32, device="cuda").view(batch, 8)
    ids = torch.zeros(batch, dtype=torch.int64, device="cuda")
    pos = torch.zeros(batch, dtype=torch.int64, device="cuda")
    attn = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.ones(batch, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        max_query_len=1,
        max_seq_len=8 * bs,
    )

    def fill(step: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(step)
        ids.copy_(torch.randint(0, spec.vocab_size, (batch,), device="cuda", generator=gen))
        lens = torch.randint(1, 8 * bs, (batch,), device="cuda", generator=gen)
        pos.copy_(lens - 1)
        attn.seq_lens.copy_(lens)
        attn.slot_mapping.copy_(tables.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs)

    fill(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(ids, pos, attn, cache)  # warm-up compiles the kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = model(ids, pos, attn, cache)
    replayed = []
    for step in (1, 2):
        fill(step)
        graph.replay()
        replayed.append(graph_out.clone())
        eager = model(ids, pos, attn, cache)
        assert rel_err(replayed[-1], eager) < 1e-3  # cuBLAS may pick other GEMMs when captured
    assert rel_err(replayed[0], replayed[1]) > 0.1  # the replay used the new inputs
