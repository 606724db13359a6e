"""Paged attention and KV-cache write: Triton kernels and the torch backend vs a float64 loop.

Triton kernels run on CPU only under TRITON_INTERPRET=1, which must be set before the kernels are
decorated; so `test_triton_kernels_under_interpreter` reruns this file's `test_interp_*` tests in
a subprocess with it set (they skip in the parent). GPU tests (bf16) skip without CUDA.
Errors are relative: ||out - ref|| / ||ref||; outputs are NaN-poisoned before each run, and so
are all cache slots no sequence owns.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from helpers import run_interpreter_tests

from engine.attention import AttentionMetadata, paged_attention_torch, write_kv_cache_torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available() and not INTERPRET
interp_only = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET subprocess")

# (query_len, prior context) per sequence: prefill chunk with context, decode, k+1 verification,
# fresh prefill, first-token decode, long decode.
MIXED = [(7, 9), (1, 20), (4, 13), (12, 0), (1, 0), (1, 37)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_batch(
    shapes: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q, K cache, V cache (all owned slots filled, the rest NaN) and metadata; block ids are a
    shuffled permutation and unused block-table entries point far out of range."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in shapes]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    width = max(need) + 1
    tables = [t + [num_blocks + 10_000] * (width - len(t)) for t in tables]
    attn = AttentionMetadata.from_lists(
        [q for q, _ in shapes], seq_lens, tables, block_size, device=device
    )
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    owned = [t[p // block_size] * block_size + p % block_size
             for t, s_len in zip(tables, seq_lens) for p in range(s_len)]  # fmt: skip
    for cache in (k_cache, v_cache):
        values = torch.randn(len(owned), num_kv_heads, head_dim, generator=gen)
        cache.view(-1, num_kv_heads, head_dim)[owned] = values.to(dtype)
    num_tokens = sum(q for q, _ in shapes)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    return q.to(device), k_cache.to(device), v_cache.to(device), attn


def reference_attention(q, k_cache, v_cache, attn: AttentionMetadata, scale: float):
    """float64, one sequence and one query token at a time."""
    q, k_cache, v_cache = q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu()
    starts = attn.query_start_loc.tolist()
    seq_lens = attn.seq_lens.tolist()
    tables = attn.block_tables.tolist()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for b, s_len in enumerate(seq_lens):
        keys = [tables[b][p // block_size] * block_size + p % block_size for p in range(s_len)]
        k = k_cache.reshape(-1, num_kv_heads, q.shape[2])[keys]  # [S, Hkv, D]
        v = v_cache.reshape(-1, num_kv_heads, q.shape[2])[keys]
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            t, pos = starts[b] + i, s_len - q_len + i
            for h in range(q.shape[1]):
                kv = h // group
                w = torch.softmax(k[: pos + 1, kv] @ q[t, h] * scale, dim=0)
                out[t, h] = w @ v[: pos + 1, kv]
    return out


TORCH_CASES = [  # (Hq, Hkv, D, block_size)
    (4, 2, 16, 4),
    (4, 4, 16, 16),
    (6, 2, 24, 8),  # group 3, head_dim not a power of two
    (8, 1, 32, 1),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("hq,hkv,d,bs", TORCH_CASES)
def test_torch_backend_matches_float64(hq, hkv, d, bs, dtype, tol):
    q, kc, vc, attn = make_batch(MIXED, hq, hkv, d, bs, dtype, seed=hq * 7 + d + bs)
    ref = reference_attention(q, kc, vc, attn, d**-0.5)
    out = torch.full_like(q, float("nan"))
    paged_attention_torch(q, kc, vc, attn, d**-0.5, out=out, max_chunk_elems=2048)
    assert rel_err(out, ref) < tol


def test_torch_backend_padding_tokens_and_bucketed_max_seq_len():
    q, kc, vc, attn = make_batch([(3, 5), (1, 8)], 4, 2, 16, 4, torch.float32)
    attn.max_seq_len += 9  # a bucket bound larger than every sequence
    ref = reference_attention(q, kc, vc, attn, 0.25)
    padded = torch.cat([q, torch.randn(2, 4, 16)])  # two graph-padding tokens
    out = paged_attention_torch(padded, kc, vc, attn, 0.25)
    assert rel_err(out[:4], ref) < 1e-5
    assert torch.equal(out[4:], torch.zeros(2, 4, 16))


def _check_kv_write(write, device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    num_tokens, hkv, d, bs, nb = 9, 2, 16, 4, 6
    qkv = torch.randn(num_tokens, (4 + 2 * hkv) * d, generator=gen).to(dtype).to(device)
    k = qkv[:, 4 * d : (4 + hkv) * d].view(num_tokens, hkv, d)  # strided, like the model's
    v = qkv[:, (4 + hkv) * d :].view(num_tokens, hkv, d)
    slots = torch.randperm(nb * bs, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1
    k_cache = torch.full((nb, bs, hkv, d), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    write(k, v, k_cache, v_cache, slots.to(device))
    k_flat, v_flat = k_cache.view(-1, hkv, d).cpu(), v_cache.view(-1, hkv, d).cpu()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_flat[s], k[t].cpu()) and torch.equal(v_flat[s], v[t].cpu())
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert k_flat[untouched].isnan().all() and v_flat[untouched].isnan().all()


def test_torch_kv_write():
    _check_kv_write(write_kv_cache_torch, "cpu", torch.float32)


def _rotary(head_dim: int, device: str = "cpu"):
    from bubblesim.core.models import PRESETS
    from engine.model import RotaryEmbedding

    spec = replace(PRESETS["tiny"], head_dim=head_dim, rope_type="llama3",
                   rope_scaling_factor=8.0, rope_original_max_context=64)  # fmt: skip
    return RotaryEmbedding(spec, 9000, torch.device(device))


def _check_decode(contexts, hq, hkv, d, bs, dtype, tol, device="cpu", pad_rows=2, seed=0, **kw):
    """decode_attention with RoPE and the KV write fused, on `contexts` (prior tokens per
    sequence) plus `pad_rows` graph-padding rows, vs torch RoPE + KV write + the float64 loop.
    The new tokens' cache slots start as NaN, so the kernel must write them before reading."""
    from engine.kernels import decode_attention
    from engine.kernels.decode_attention import _COUNTERS

    q, kc, vc, attn = make_batch([(1, c) for c in contexts], hq, hkv, d, bs, dtype, seed=seed)
    b, t = len(contexts), len(contexts) + pad_rows
    rot = _rotary(d)
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q_new = qkv[:, : hq * d].view(t, hq, d)  # strided views, like the model's
    k_new = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v_new = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    positions = torch.tensor(list(contexts) + [0] * pad_rows)
    slots = torch.cat([attn.slot_mapping, torch.full((pad_rows,), -1)])
    k_ref, v_ref = kc.clone(), vc.clone()
    write_kv_cache_torch(rot(positions, k_new.clone()), v_new, k_ref, v_ref, slots)
    # the vectorised float64 reference (checked against the loop above), on the device: fast
    ref_attn = replace(
        attn,
        **{
            f: getattr(attn, f).to(device)
            for f in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")
        },
    )
    q_rot = rot(positions, q_new.clone())[:b].to(device).double()
    ref = paged_attention_torch(q_rot, k_ref.to(device).double(), v_ref.to(device).double(),
                                ref_attn, d**-0.5).cpu()  # fmt: skip
    owned = attn.slot_mapping
    kc.view(-1, hkv, d)[owned] = float("nan")
    vc.view(-1, hkv, d)[owned] = float("nan")

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to(device)

    i32 = torch.int32
    qsl = torch.cat([attn.query_start_loc, torch.full((pad_rows,), b, dtype=i32)])
    seq_lens = torch.cat([attn.seq_lens, torch.ones(pad_rows, dtype=i32)])
    tables = torch.cat([attn.block_tables, torch.zeros(pad_rows, attn.block_tables.shape[1],
                                                       dtype=i32)])  # fmt: skip
    kc, vc, qkv = dev(kc), dev(vc), dev(qkv)
    out = torch.full((t, hq, d), float("nan"), dtype=dtype, device=device)
    decode_attention(
        qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d),
        qkv[:, (hq + hkv) * d :].view(t, hkv, d), kc, vc, dev(qsl), dev(seq_lens), dev(tables),
        max(contexts) + 1, d**-0.5, cos=dev(rot.cos),
        sin=dev(rot.sin), slot_mapping=dev(slots), out=out, **kw,
    )  # fmt: skip
    assert rel_err(out[:b].cpu(), ref) < tol
    assert rel_err(kc.view(-1, hkv, d)[owned].cpu(), k_ref.view(-1, hkv, d)[owned]) < tol
    assert torch.equal(vc.view(-1, hkv, d)[owned].cpu(), v_ref.view(-1, hkv, d)[owned])
    assert all(not c.any() for c in _COUNTERS.values()), "split counters left non-zero"


def _check_skinny_gemm(m, n, k, dtype, tol, device="cpu", config=None, seed=0) -> None:
    """skinny_gemm plain, with the SiLU*up epilogue ([gate; up] weight rows) and with fp32
    output, each vs float64 torch."""
    import torch.nn.functional as F

    from engine.kernels import skinny_gemm

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x, w = rand(m, k), rand(2 * n, k, scale=2 * k**-0.5)
    x64, w64 = x.double(), w.double()
    gate, up = (x64 @ w64.T).chunk(2, dim=-1)
    out = skinny_gemm(x, w, config=config)
    assert out.dtype == dtype and rel_err(out.cpu(), (x64 @ w64.T).cpu()) < tol
    act = skinny_gemm(x, w, silu_mul=True, config=config)
    assert act.shape == (m, n) and rel_err(act.cpu(), (F.silu(gate) * up).cpu()) < tol
    logits = skinny_gemm(x, w, out_dtype=torch.float32, config=config)
    assert logits.dtype == torch.float32 and rel_err(logits.cpu(), (x64 @ w64.T).cpu()) < tol


# ---- Triton under the interpreter (subprocess) ------------------------------------------------


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run")
@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    run_interpreter_tests(__file__, timeout_s=900)


@interp_only
def test_interp_kv_write():
    from engine.kernels import write_kv_cache

    _check_kv_write(write_kv_cache, "cpu", torch.float32)
    _check_kv_write(write_kv_cache, "cpu", torch.float16)


INTERP_CASES = [  # (Hq, Hkv, D, block_size, block_m, block_n, num_splits)
    (4, 2, 16, 4, 0, 16, 1),
    (4, 2, 16, 4, 16, 16, 4),  # 8 query tokens per program: several query blocks
    (6, 2, 24, 8, 0, 16, 2),  # group 3 (rows padded), head_dim not a power of two
    (8, 1, 16, 16, 16, 32, 1),  # group 8: 2 query tokens per program
    (2, 2, 32, 2, 0, 16, 8),  # more splits than some sequences have tiles
]


@interp_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
@pytest.mark.parametrize("case", INTERP_CASES)
def test_interp_paged_attention(case, dtype, tol):
    from engine.kernels import paged_attention

    hq, hkv, d, bs, block_m, block_n, splits = case
    q, kc, vc, attn = make_batch(MIXED, hq, hkv, d, bs, dtype, seed=sum(case))
    ref = reference_attention(q, kc, vc, attn, d**-0.5)
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, kc, vc, attn.query_start_loc, attn.seq_lens, attn.block_tables,
        attn.max_query_len, attn.max_seq_len, d**-0.5,
        out=out, num_splits=splits, block_m=block_m, block_n=block_n,
    )  # fmt: skip
    assert rel_err(out, ref) < tol


# one-token rows with long contexts beside prefill chunks (decode splits of a mixed batch)
MIXED_LONG_DECODES = [(1, 70), (20, 9), (1, 3), (5, 0), (1, 130), (17, 40), (1, 0)]


@interp_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
@pytest.mark.parametrize("decode_splits,min_tiles", [(2, 1), (4, 1), (4, 3), (8, 1)])
def test_interp_paged_attention_decode_splits(decode_splits, min_tiles, dtype, tol):
    """Split one-token rows (partials per sequence, merged per sequence), prefill rows whole;
    more splits than some rows have tiles, and runs of several tiles (min_tiles)."""
    from engine.kernels import paged_attention

    q, kc, vc, attn = make_batch(MIXED_LONG_DECODES, 4, 2, 16, 4, dtype, seed=decode_splits)
    ref = reference_attention(q, kc, vc, attn, 0.25)
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, kc, vc, attn.query_start_loc, attn.seq_lens, attn.block_tables,
        attn.max_query_len, attn.max_seq_len, 0.25, out=out, num_splits=1, block_n=16,
        decode_splits=decode_splits, min_tiles=min_tiles,
    )  # fmt: skip
    assert rel_err(out, ref) < tol


@interp_only
def test_interp_bucketed_grid_and_padding_tokens():
    """A grid sized for a larger query-length bucket, and tokens past the last sequence."""
    from engine.kernels import paged_attention

    q, kc, vc, attn = make_batch([(1, 6), (2, 3), (1, 0)], 4, 2, 16, 4, torch.float32, seed=5)
    ref = reference_attention(q, kc, vc, attn, 0.25)
    out = torch.full((q.shape[0] + 3, 4, 16), float("nan"))
    padded_q = torch.cat([q, torch.randn(3, 4, 16)])
    paged_attention(
        padded_q, kc, vc, attn.query_start_loc, attn.seq_lens, attn.block_tables,
        max_query_len=16, max_seq_len=64, scale=0.25, out=out, block_n=16, num_splits=2,
    )  # fmt: skip
    assert rel_err(out[: q.shape[0]], ref) < 1e-5


DECODE_CASES = [  # (Hq, Hkv, D, block_size, block_n, num_splits)
    (4, 2, 16, 4, 16, 1),
    (4, 2, 16, 4, 16, 4),  # splits: partials merged by the last split of each (seq, kv head)
    (6, 2, 24, 8, 16, 2),  # group 3 (rows padded), head_dim not a power of two
    (8, 1, 32, 1, 16, 8),  # group 8, block_size 1
    (4, 4, 16, 16, 32, 32),  # more splits than any sequence has tiles
]


@interp_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_interp_decode_attention_rope_and_kv_write(case, dtype, tol):
    hq, hkv, d, bs, block_n, splits = case
    contexts = [0, 20, 37, 5, 64, 100]  # 0: the first decode after an empty prompt
    _check_decode(contexts, hq, hkv, d, bs, dtype, tol, seed=sum(case), num_splits=splits,
                  block_n=block_n)  # fmt: skip


@interp_only
@pytest.mark.parametrize("min_tiles", [2, 3])
def test_interp_decode_attention_splits_only_long_sequences(min_tiles):
    """Large-batch rule: a split takes at least `min_tiles` tiles, so short sequences run in
    one program (direct write) and long ones in several (merged), in the same launch."""
    contexts = [3, 20, 150, 9, 200, 33]
    _check_decode(contexts, 4, 2, 16, 4, torch.float32, 1e-5, num_splits=8, block_n=16,
                  min_tiles=min_tiles)  # fmt: skip


@interp_only
def test_interp_decode_attention_without_rope_matches_paged_attention():
    """The PagedAttention entry with max_query_len == 1 (no RoPE): write, then attend."""
    from engine.attention import PagedAttention

    q, kc, vc, attn = make_batch([(1, 9), (1, 0), (1, 30)], 4, 2, 16, 4, torch.float32, seed=2)
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 3, 2, 16, generator=gen)
    k_ref, v_ref = kc.clone(), vc.clone()
    write_kv_cache_torch(k, v, k_ref, v_ref, attn.slot_mapping)
    ref = reference_attention(q, k_ref, v_ref, attn, 0.25)
    attn.num_kv_splits = 2
    out = PagedAttention("triton", "cpu")(q, k, v, torch.stack([kc, vc]), attn, 0.25)
    assert rel_err(out, ref) < 1e-5


@interp_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
def test_interp_rope_write_kv(dtype, tol):
    from engine.kernels import rope_write_kv

    gen = torch.Generator().manual_seed(6)
    t, hq, hkv, d, bs, nb = 7, 6, 2, 24, 4, 5
    rot = _rotary(d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    positions = torch.randint(0, 9000, (t,), generator=gen)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[3] = -1
    kc = torch.full((nb, bs, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    k_ref, v_ref = kc.clone(), vc.clone()
    q_ref = rot(positions, q.clone())
    write_kv_cache_torch(rot(positions, k.clone()), v, k_ref, v_ref, slots)
    k_before = k.clone()
    rope_write_kv(q, k, v, positions, rot.cos, rot.sin, kc, vc, slots)
    assert rel_err(q, q_ref) < tol and torch.equal(k, k_before)
    kept = slots[slots >= 0]
    assert rel_err(kc.view(-1, hkv, d)[kept], k_ref.view(-1, hkv, d)[kept]) < tol
    assert torch.equal(vc.view(-1, hkv, d)[kept], v_ref.view(-1, hkv, d)[kept])
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[kept] = False
    assert kc.view(-1, hkv, d)[untouched].isnan().all()


@interp_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
def test_interp_silu_mul(dtype, tol):
    import torch.nn.functional as F

    from engine.kernels import silu_mul

    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(7)).to(dtype) * 3
    gate, up = x.chunk(2, dim=-1)
    assert rel_err(silu_mul(x), F.silu(gate) * up) < tol


@interp_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("m", [1, 5])
def test_interp_skinny_gemm_and_epilogues(m, dtype, tol):
    _check_skinny_gemm(m, 48, 64, dtype, tol, config=(16, 32, 2, 4), seed=m)


@interp_only
@pytest.mark.parametrize("skinny_rows,fuse_silu", [(4, True), (4, False), (0, False)])
def test_interp_model_decode_steps_triton_match_torch(monkeypatch, skinny_rows, fuse_silu):
    """Decode steps (the fused RoPE + KV write + decode attention path; skinny GEMMs with and
    without the SiLU*up epilogue, or F.linear) after a prefill (F.linear: more tokens)."""
    import engine.model

    try:
        from tests.test_model import run_decode_steps
    except ImportError:  # tests/ on sys.path, not the repo root
        from test_model import run_decode_steps

    monkeypatch.setattr(engine.model, "SKINNY_MAX_ROWS", skinny_rows)
    monkeypatch.setattr(engine.model, "SKINNY_FUSE_SILU", fuse_silu)
    assert rel_err(run_decode_steps("triton"), run_decode_steps("torch")) < 1e-5


@interp_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
def test_interp_fused_rms_norm(dtype, tol):
    from engine.kernels import rms_norm
    from engine.model import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(5, 48, generator=gen).to(dtype) for _ in range(2))
    norm = RMSNorm(48, 1e-5, dtype, "cpu")
    norm.weight.copy_(torch.randn(48, generator=gen))
    ref_out, ref_res = norm(x, res)
    out, new_res = rms_norm(x, norm.weight, 1e-5, res.clone())
    assert rel_err(out, ref_out) < tol and torch.equal(new_res, ref_res)
    out, same = rms_norm(x, norm.weight, 1e-5)
    assert rel_err(out, norm(x)[0]) < tol and same is x


@interp_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
def test_interp_rope_in_place_on_strided_qk(dtype, tol):
    from bubblesim.core.models import PRESETS
    from engine.kernels import rope_inplace
    from engine.model import RotaryEmbedding

    spec = replace(PRESETS["tiny"], rope_type="llama3", rope_scaling_factor=8.0,
                   rope_original_max_context=64)  # fmt: skip
    rotary = RotaryEmbedding(spec, 300, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 8 * 16, generator=gen).to(dtype)  # 4 q + 2 k + 2 v heads
    qk = qkv[:, : 6 * 16].view(7, 6, 16)
    positions = torch.randint(0, 300, (7,), generator=gen)
    ref = rotary(positions, qk.clone())
    v_before = qkv[:, 6 * 16 :].clone()
    rope_inplace(qk, positions, rotary.cos, rotary.sin)
    assert rel_err(qk, ref) < tol and torch.equal(qkv[:, 6 * 16 :], v_before)


@interp_only
def test_interp_model_triton_backend_matches_torch_backend():
    try:
        from tests.test_model import run_mixed_step
    except ImportError:  # tests/ on sys.path, not the repo root
        from test_model import run_mixed_step

    out_torch = run_mixed_step("torch")
    out_triton = run_mixed_step("triton")  # 8 tokens: the skinny path when it is on
    assert rel_err(out_triton, out_torch) < 1e-5


# ---- compiled (not interpreted) lowering, without a GPU ----------------------------------------


def _compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int = 4) -> None:
    """Lower a kernel to an sm_90 cubin as the JIT would (16-aligned pointers and strides)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    aligned = [n for n in signature if n.endswith("_ptr") or n.startswith("stride")]
    src = ASTSource(
        fn=fn,
        signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


@pytest.mark.skipif(INTERPRET or HAS_CUDA, reason="CPU-only check; GPU tests compile for real")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.slow
def test_kernels_lower_to_sm90_cubin():
    """The interpreter skips Triton's compiler; this catches what only lowering rejects."""
    import importlib

    pytest.importorskip("triton.backends.nvidia")
    mods = {m: importlib.import_module(f"engine.kernels.{m}") for m in
            ("paged_attention", "kv_cache_write", "rms_norm", "rope")}  # fmt: skip
    i32, bf16, f32 = "i32", "*bf16", "*fp32"
    attn = dict(q_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16, out_ptr=bf16, part_acc_ptr=f32,
                part_ml_ptr=f32, query_start_loc_ptr="*i32", seq_lens_ptr="*i32",
                block_tables_ptr="*i32", scale_log2="fp32", num_tokens=i32, num_seqs=i32,
                min_tiles=i32, stride_q_t=i32, stride_q_h=i32, stride_o_t=i32, stride_o_h=i32,
                stride_bt=i32, stride_cache_block=i32)  # fmt: skip
    for block_m, head_dim, splits, decode_splits, flat in [
        (16, 128, 1, 1, 0), (64, 128, 1, 1, 0), (16, 64, 4, 1, 0), (64, 128, 1, 8, 0),
        (64, 64, 1, 2, 0), (64, 128, 1, 1, 256), (64, 128, 1, 8, 256),  # flat: mixed graphs
    ]:  # fmt: skip
        consts = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=head_dim,
                      DIM_PAD=head_dim, BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // 4,
                      BLOCK_N=64, NUM_SPLITS=splits, DECODE_SPLITS=decode_splits,
                      FLAT_SEQS=flat)  # fmt: skip
        _compile_sm90(mods["paged_attention"]._paged_attention_kernel, attn, consts)
    reduce = dict(part_acc_ptr=f32, part_ml_ptr=f32, out_ptr=bf16, query_start_loc_ptr="*i32",
                  seq_lens_ptr="*i32", num_seqs=i32, num_tokens=i32, min_tiles=i32,
                  stride_o_t=i32, stride_o_h=i32)  # fmt: skip
    for by_seq in (False, True):
        consts = dict(NUM_Q_HEADS=32, HEAD_DIM=128, DIM_PAD=128, NUM_SPLITS=4, BLOCK_N=64,
                      BY_SEQ=by_seq)  # fmt: skip
        _compile_sm90(mods["paged_attention"]._reduce_splits_kernel, reduce, consts)
    write = dict(k_ptr=bf16, v_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16,
                 slot_mapping_ptr="*i32", stride_k_t=i32, stride_k_h=i32, stride_v_t=i32,
                 stride_v_h=i32, stride_cache_block=i32)  # fmt: skip
    consts = dict(BLOCK_SIZE=16, NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, DIM_PAD=128)
    _compile_sm90(mods["kv_cache_write"]._write_kv_kernel, write, consts)
    norm = dict(x_ptr=bf16, residual_ptr=bf16, weight_ptr=bf16, out_ptr=bf16, stride_x=i32,
                stride_r=i32, stride_o=i32, size=i32, eps="fp32")  # fmt: skip
    for on in (False, True):  # PDL: gdc wait / launch-dependents lower on sm90
        consts = dict(HAS_RESIDUAL=True, BLOCK=4096, PDL=on)
        _compile_sm90(mods["rms_norm"]._rms_norm_kernel, norm, consts)
    rope = dict(x_ptr=bf16, positions_ptr="*i32", cos_ptr=f32, sin_ptr=f32, stride_x_t=i32,
                stride_x_h=i32, stride_cs=i32)  # fmt: skip
    consts = dict(NUM_HEADS=40, HALF=64, HEADS_PAD=64, HALF_PAD=64)
    _compile_sm90(mods["rope"]._rope_kernel, rope, consts)
    dec = importlib.import_module("engine.kernels.decode_attention")
    sig = dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, cos_ptr=f32, sin_ptr=f32,
               slot_mapping_ptr="*i64", k_cache_ptr=bf16, v_cache_ptr=bf16, out_ptr=bf16,
               part_acc_ptr=f32, part_ml_ptr=f32, counter_ptr="*i32",
               query_start_loc_ptr="*i32", seq_lens_ptr="*i32", block_tables_ptr="*i32",
               scale_log2="fp32", min_tiles=i32, **dict.fromkeys(
                   ["stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h", "stride_v_t",
                    "stride_v_h", "stride_o_t", "stride_o_h", "stride_cs", "stride_bt",
                    "stride_cache_block"], i32))  # fmt: skip
    for head_dim, splits, block_n, rope_on in [(128, 1, 64, True), (128, 16, 64, True),
                                               (64, 4, 32, False)]:  # fmt: skip
        consts = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, GROUP=4, GROUP_P2=4, GROUP_PAD=16,
                      HEAD_DIM=head_dim, DIM_PAD=head_dim, HALF=head_dim // 2, BLOCK_SIZE=16,
                      BLOCK_N=block_n, NUM_SPLITS=splits, ROPE=rope_on,
                      WRITE_KV=rope_on, PDL=rope_on)  # fmt: skip
        _compile_sm90(dec._decode_attention_kernel, sig, consts)
    sig = dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, positions_ptr="*i64", cos_ptr=f32,
               sin_ptr=f32, k_cache_ptr=bf16, v_cache_ptr=bf16, slot_mapping_ptr="*i64",
               **dict.fromkeys(["stride_q_t", "stride_q_h", "stride_k_t", "stride_k_h",
                                "stride_v_t", "stride_v_h", "stride_cs", "stride_cache_block"],
                               i32))  # fmt: skip
    consts = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, Q_HEADS_PAD=32,
                  KV_HEADS_PAD=8, HALF_PAD=64, DIM_PAD=128, BLOCK_SIZE=16)  # fmt: skip
    _compile_sm90(mods["kv_cache_write"]._rope_write_kv_kernel, sig, consts)
    act = importlib.import_module("engine.kernels.activation")
    sig = dict(x_ptr=bf16, out_ptr=bf16, stride_x=i32, stride_o=i32, size=i32)
    _compile_sm90(act._silu_mul_kernel, sig, dict(BLOCK=1024))
    gemm = importlib.import_module("engine.kernels.skinny_gemm")
    sig = dict(x_ptr=bf16, w_ptr=bf16, out_ptr=bf16, M=i32, N=i32, K=i32, stride_xm=i32,
               stride_wn=i32, stride_om=i32)  # fmt: skip
    for silu in (False, True):
        consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SILU_MUL=silu, PDL=silu,
                      PREFETCH_LINES=8, LINE=64)  # fmt: skip
        _compile_sm90(gemm._skinny_gemm_kernel, sig, consts)
    smp = importlib.import_module("engine.kernels.sampling")
    sig = dict(logits_ptr=f32, stride_row=i32, vocab=i32, part_max_ptr=f32, part_idx_ptr="*i32")
    _compile_sm90(smp._chunk_max_kernel, sig, dict(NUM_CHUNKS=32, CHUNK=4096, PDL=True))
    sig = dict(part_max_ptr=f32, **dict.fromkeys(
        ["part_idx_ptr", "forced_ptr", "slot_ptr", "out_ptr", "last_ptr"], "*i32"))  # fmt: skip
    _compile_sm90(smp._merge_kernel, sig, dict(NUM_CHUNKS=32, BLOCK=32, PDL=True))
    sig = dict(raw_ptr="*i32", last_ptr="*i32", out_ptr="*i32", n=i32)
    _compile_sm90(smp._resolve_ids_kernel, sig, dict(BLOCK=1024))


# ---- GPU (bf16) --------------------------------------------------------------------------------


def _gpu_attention(q, kc, vc, attn, scale, **kw):
    from engine.kernels import paged_attention

    out = torch.full_like(q, float("nan"))
    return paged_attention(
        q, kc, vc, attn.query_start_loc, attn.seq_lens, attn.block_tables,
        attn.max_query_len, attn.max_seq_len, scale, out=out, **kw,
    )  # fmt: skip


GPU_MIXED = [(300, 40), (1, 700), (4, 250), (1, 1), (97, 0), (1, 513), (4, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [0, 1, 4])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (32, 8, 64), (24, 8, 128)])
def test_gpu_paged_attention_mixed_bf16(hq, hkv, d, splits):
    q, kc, vc, attn = make_batch(GPU_MIXED, hq, hkv, d, 16, torch.bfloat16, "cuda", seed=hq + d)
    kc, vc = kc.cuda(), vc.cuda()
    ref = reference_attention(q, kc, vc, attn, d**-0.5)
    out = _gpu_attention(q, kc, vc, attn, d**-0.5, num_splits=splits)
    assert rel_err(out.cpu(), ref) < 1.5e-2


@pytest.mark.gpu
def test_gpu_mixed_batch_with_long_decodes_bf16():
    """The automatic decode-split rule of a mixed batch: prefill chunks beside short and long
    one-token rows (12000 keys: 4 splits of 4096)."""
    from engine.kernels.paged_attention import choose_decode_splits

    shapes = [(1, 300 + 9 * i) for i in range(40)] + [(1, 12000), (700, 500), (1, 5000), (33, 0)]
    assert choose_decode_splits(700, 12001, torch.device("cuda")) == 4
    q, kc, vc, attn = make_batch(shapes, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=3)
    kc, vc = kc.cuda(), vc.cuda()
    out = _gpu_attention(q, kc, vc, attn, 128**-0.5)
    ref = reference_attention(q, kc, vc, attn, 128**-0.5)
    assert rel_err(out.cpu(), ref) < 1.5e-2


@pytest.mark.gpu
def test_gpu_decode_large_batch_with_a_long_sequence_bf16():
    """The automatic large-batch split rule on a batch of short contexts and one long one."""
    contexts = [300 + 5 * i for i in range(47)] + [8000]  # the test RoPE table: 9000 positions
    _check_decode(contexts, 32, 8, 128, 16, torch.bfloat16, 1.5e-2, "cuda", seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [0, 1, 8])
def test_gpu_decode_batch64_bf16(splits):
    shapes = [(1, 400 + 7 * i) for i in range(64)]
    q, kc, vc, attn = make_batch(shapes, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=11)
    kc, vc = kc.cuda(), vc.cuda()
    out = _gpu_attention(q, kc, vc, attn, 128**-0.5, num_splits=splits)
    ref = paged_attention_torch(q.double(), kc.double(), vc.double(), attn, 128**-0.5)
    assert rel_err(out, ref) < 1.5e-2


@pytest.mark.gpu
def test_gpu_kv_write_bf16():
    from engine.kernels import write_kv_cache

    _check_kv_write(write_kv_cache, "cuda", torch.bfloat16)


@pytest.mark.gpu
def test_gpu_fused_norm_and_rope_bf16():
    from bubblesim.core.models import PRESETS
    from engine.kernels import rms_norm, rope_inplace
    from engine.model import RMSNorm, RotaryEmbedding

    spec = PRESETS["llama3-8b"]
    x, res = (torch.randn(33, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    norm = RMSNorm(4096, 1e-5, torch.bfloat16, "cuda")
    norm.weight.copy_(torch.rand(4096, device="cuda") + 0.5)
    ref_out, ref_res = norm(x, res)
    out, new_res = rms_norm(x, norm.weight, 1e-5, res.clone())
    assert rel_err(out, ref_out) < 1e-2 and torch.equal(new_res, ref_res)
    rotary = RotaryEmbedding(spec, 4096, torch.device("cuda"))
    qk = torch.randn(33, 40, 128, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (33,), device="cuda")
    ref = rotary(positions, qk.clone())
    assert rel_err(rope_inplace(qk, positions, rotary.cos, rotary.sin), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [0, 1, 8, 32])
@pytest.mark.parametrize("num_seqs", [1, 8, 64])
def test_gpu_decode_attention_rope_kv_write_bf16(num_seqs, splits):
    contexts = [(37 * i + 500) % 1500 for i in range(num_seqs)]
    contexts[0] = 0
    _check_decode(contexts, 32, 8, 128, 16, torch.bfloat16, 1.5e-2, "cuda", seed=num_seqs,
                  num_splits=splits)  # fmt: skip


@pytest.mark.gpu
def test_gpu_decode_attention_in_cuda_graph_follows_seq_lens():
    """Captured once with a large max_seq_len; replays with other lengths == eager."""
    from engine.kernels import decode_attention

    shapes = [(1, 3000), (1, 40), (1, 700), (1, 1)]
    q, kc, vc, attn = make_batch(shapes, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=3)
    kc, vc = kc.cuda(), vc.cuda()
    out = torch.empty_like(q)

    def run():
        decode_attention(q, q, q, kc, vc, attn.query_start_loc, attn.seq_lens,
                         attn.block_tables, 131072, 128**-0.5, out=out)  # fmt: skip

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ([3001, 41, 701, 2], [17, 33, 5, 1], [1500, 2, 700, 2]):  # <= the tables
        attn.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        ref = paged_attention_torch(q.double(), kc.double(), vc.double(), attn, 128**-0.5)
        assert rel_err(out, ref) < 1.5e-2


@pytest.mark.gpu
def test_gpu_rope_write_kv_and_silu_mul_bf16():
    import torch.nn.functional as F

    from engine.kernels import rope_write_kv, silu_mul

    gen = torch.Generator(device="cuda").manual_seed(0)
    t, hq, hkv, d = 33, 32, 8, 128
    rot = _rotary(d, "cuda")
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=gen).bfloat16()
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    positions = torch.randint(0, 9000, (t,), device="cuda", generator=gen)
    slots = torch.randperm(64 * 16, device="cuda", generator=gen)[:t]
    kc = torch.zeros(64, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc, k_ref, v_ref = kc.clone(), kc.clone(), kc.clone()
    q_ref = rot(positions, q.clone())
    write_kv_cache_torch(rot(positions, k.clone()), v, k_ref, v_ref, slots)
    rope_write_kv(q, k, v, positions, rot.cos, rot.sin, kc, vc, slots)
    assert rel_err(q, q_ref) < 1e-2 and rel_err(kc, k_ref) < 1e-2 and torch.equal(vc, v_ref)
    x = torch.randn(9, 2 * 14336, device="cuda", generator=gen).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    assert rel_err(silu_mul(x), F.silu(gate) * up) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_skinny_gemm_and_epilogues_bf16(m):
    _check_skinny_gemm(m, 4096 + 96, 4096, torch.bfloat16, 1e-2, "cuda", seed=m)
    _check_skinny_gemm(m, 14336, 4096, torch.bfloat16, 1e-2, "cuda", seed=m + 1)


# ---- sampling kernels (engine.kernels.sampling) -----------------------------------------------


def _check_greedy_sample(rows: int, vocab: int, device: str, dtype: torch.dtype) -> None:
    from engine.kernels.sampling import GreedyWorkspace, greedy_sample

    gen = torch.Generator().manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    logits[0, 5] = logits[0, vocab - 3] = logits[0].max() + 1  # a tie: the lower index wins
    if rows > 2:
        logits[2, 4096 * (vocab // 4096) - 1] = 100.0  # the max at a chunk's last element
        logits[3, [vocab - 2, 4100, 4099]] = float("nan")  # NaN is the max: the first NaN
    forced = torch.full((rows,), -1, dtype=torch.int32)
    forced[1::3] = torch.arange(len(forced[1::3]), dtype=torch.int32) + 7
    slots = torch.randperm(rows, generator=gen).to(torch.int32)
    logits, forced, slots = logits.to(device), forced.to(device), slots.to(device)
    last = torch.full((rows + 1,), -5, dtype=torch.int32, device=device)
    out = torch.full((rows,), -9, dtype=torch.int32, device=device)
    greedy_sample(logits, forced, slots, out, last, GreedyWorkspace(rows, vocab, logits.device))
    want = torch.where(forced >= 0, forced, logits.float().argmax(-1).to(torch.int32))
    assert int(want[0]) == 5  # row 0 is not forced: the tie went to the lower index
    assert torch.equal(out, want)
    assert torch.equal(last[slots.long()], want) and int(last[rows]) == -5


@interp_only
@pytest.mark.parametrize("rows,vocab", [(1, 300), (4, 9000)])
def test_interp_greedy_sample_and_input_ids(rows, vocab):
    from engine.kernels.sampling import resolve_input_ids

    _check_greedy_sample(rows, vocab, "cpu", torch.float32)
    raw = torch.tensor([5, -1, 9, -3, -2, 0], dtype=torch.int32)
    last = torch.tensor([11, 22, 33], dtype=torch.int32)
    out = torch.zeros(6, dtype=torch.int32)
    resolve_input_ids(raw, last, out)
    assert out.tolist() == [5, 11, 9, 33, 22, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_greedy_sample(rows):
    _check_greedy_sample(rows, 128256, "cuda", torch.float32)
    _check_greedy_sample(rows, 32000, "cuda", torch.bfloat16)
