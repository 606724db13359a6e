"""`cuda_graphs_mixed`: prefill and mixed steps replay a CUDA graph per token bucket
(engine.mixed_graphs). On CPU the same padded, static-metadata step runs eagerly, so the CPU
tests below pin that path against the plain one; the flat attention grid it needs is checked
under the Triton interpreter (subprocess), and the graphs themselves by the GPU tests (bf16
logits, greedy tokens in float32, forced tokens, no hidden sync, start-up cost)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest
import torch

from bubblesim.core.config import Config
from bubblesim.core.graph_buckets import mixed_graph_buckets, mixed_graph_tokens
from engine.engine import Engine
from engine.requests import RequestInput
from sim.cost import model as cost_model

ROOT = Path(__file__).resolve().parents[1]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available() and not INTERPRET
interp_only = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET subprocess")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]


def make_cfg(**kw) -> Config:
    """The shared tiny CPU config with mixed-step graphs on (run eagerly on CPU)."""
    return helpers.make_cfg(**{"cuda_graphs": True, "cuda_graphs_mixed": True, **kw})


def workload(n: int, seed: int = 0, forced_every: int = 0, history_every: int = 0):
    """Prompts longer than the token budget (chunked prefill), half of them sharing a 48-token
    prefix (prefix-cache hits once the first is cached)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 500, 48)
    out = []
    for i in range(n):
        p, o = int(rng.integers(8, 140)), int(rng.integers(3, 24))
        ids = rng.integers(0, 500, p)
        if i % 2 and p > 48:
            ids[:48] = shared
        forced = rng.integers(0, 500, o) if forced_every and i % forced_every == 0 else None
        hist = bool(history_every) and i % history_every == 0
        out.append(RequestInput(f"r{i}", p, o, 0.0, ids, forced, needs_history=hist))
    return out


LATE = [  # (after step, request): joining mid-run, beside running decodes
    (20, RequestInput("late0", 90, 12, 0.0, np.arange(90) % 500)),
    (30, RequestInput("late1", 5, 6, 0.0, np.arange(5) + 7)),
    (36, RequestInput("late2", 21, 6, 0.0, np.arange(21) + 3)),
]


rows_used: list[int] = []


def run(cfg: Config, reqs, model=None):
    """Serve `reqs` (all at once) while the LATE requests join at their steps. Returns the
    tokens of all (LATE last), the engine and the mixed-graph bucket of each padded step
    (`rows_used` gets its sampling rows)."""
    eng = Engine(cfg, model)
    used: list[int] = []
    fill = eng.inputs.fill

    def spy(*a, **kw):
        step = fill(*a, **kw)
        if step.mixed:
            used.append(step.bucket)
            rows_used.append(step.mixed)
        return step

    eng.inputs.fill = spy  # type: ignore[method-assign]
    joined: list[int] = []
    steps = [0]

    def on_step(e: Engine) -> None:
        steps[0] += 1
        joined.extend(e.add_request(r) for at, r in LATE if at == steps[0])

    outs = eng.run(reqs, arrival="asap", on_step=on_step)
    while eng.has_work:
        eng.step()
    assert len(joined) == len(LATE), "the run ended before the late requests could join"
    tokens = [o.token_ids for o in outs] + [eng.states[i].result().token_ids for i in joined]
    return tokens, eng, used


# ---- the bucket rule ---------------------------------------------------------------------------
def test_one_bucket_rule_for_the_engine_and_the_simulator():
    assert cost_model.mixed_graph_tokens is mixed_graph_tokens
    assert mixed_graph_buckets(8192)[:11] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768]
    assert mixed_graph_buckets(8192)[-1] == 8192 and len(mixed_graph_buckets(8192)) == 40
    assert mixed_graph_buckets(1000)[-1] == 1024
    for n in range(1, 2000):  # every step lands in a listed bucket, the smallest that fits
        b = mixed_graph_tokens(n)
        assert b >= n and b in mixed_graph_buckets(n)


# ---- CPU: the padded, static-metadata path run eagerly ------------------------------------------
@pytest.mark.parametrize("depth", [1, 2])
def test_bucketed_path_emits_the_plain_paths_greedy_tokens(depth):
    reqs = workload(10)
    off, eng_off, _ = run(make_cfg(cuda_graphs_mixed=False, batches_in_flight=depth), reqs)
    on, eng_on, used = run(make_cfg(batches_in_flight=depth), reqs, model=eng_off.model)
    assert eng_on.mixed is not None and not eng_on.mixed.graphs  # CPU: no graphs captured
    assert on == off
    assert [len(t) for t in on] == [r.output_len for r in reqs + [r for _, r in LATE]]
    # padded steps of several buckets, some holding decode rows beside prefill chunks
    assert len(used) > 10 and len(set(used)) >= 3, used
    assert all(b in eng_on.mixed.buckets for b in used)
    assert sum(st.req.num_cached_tokens for st in eng_on.states) > 0  # prefix-cache hits


def test_bucketed_path_with_few_and_many_sampling_rows():
    """max_num_seqs 32: buckets of 32+ tokens have a 16-row graph (prefill-heavy steps) and a
    32-row one (steps sampling more); both give the plain path's tokens."""
    rng = np.random.default_rng(3)  # 20 short prompts decoding while LATE's prefill runs
    reqs = [RequestInput(f"s{i}", 8, 50, 0.0, rng.integers(0, 500, 8)) for i in range(20)]
    cfg = make_cfg(max_num_seqs=32, num_kv_blocks=400)
    off, eng_off, _ = run(cfg.replace(cuda_graphs_mixed=False), reqs)
    rows_used.clear()
    on, eng_on, used = run(cfg, reqs, model=eng_off.model)
    assert on == off
    assert eng_on.mixed is not None and eng_on.mixed.row_options(64) == [16, 32]
    assert {16, 32} <= set(rows_used), rows_used


def test_bucketed_path_with_sampling_penalties_and_forced_tokens():
    """Seeded random sampling with penalties (the with-history variant) and forced outputs:
    the padded rows sample into the spare slot and change no request's state."""
    sampling = [("temperature", 0.8), ("top_k", 20), ("repetition_penalty", 1.3)]
    reqs = workload(9, seed=2, forced_every=3, history_every=2)
    off, eng_off, _ = run(make_cfg(cuda_graphs_mixed=False, sampling=sampling), reqs)
    on, eng_on, used = run(make_cfg(sampling=sampling), reqs, model=eng_off.model)
    assert eng_on.mixed is not None and eng_on.mixed.variants == (False, True)
    assert on == off and len(used) > 5
    for r, toks in zip(reqs, on):
        if r.output_ids is not None:
            assert toks == list(r.output_ids)
    # the same slot state: padded rows counted nothing (same schedule, so the same slots)
    assert torch.equal(eng_on.sampler.counts[:-1], eng_off.sampler.counts[:-1])
    assert eng_on.sampler.counts[:-1].sum() > 0


def test_input_buffers_hold_the_largest_bucket():
    eng = Engine(make_cfg(max_num_batched_tokens=600))
    assert eng.mixed is not None and eng.mixed.max_bucket == 768
    assert eng.inputs.max_tokens == 768
    assert eng.mixed.seq_rows(768) == 8 and eng.mixed.seq_rows(2) == 2
    assert eng.mixed.row_options(768) == [8]  # max_num_seqs 8: one graph per bucket
    big = Engine(make_cfg(max_num_seqs=64, max_num_batched_tokens=128))
    assert big.mixed is not None and big.mixed.row_options(128) == [16, 64]
    assert big.mixed.rows_for(128, 3) == 16 and big.mixed.rows_for(128, 17) == 64
    assert big.mixed.row_options(8) == [8] and big.mixed.rows_for(8, 0) == 8


def test_spec_decoding_leaves_mixed_steps_eager_as_the_cost_model_says():
    cfg = make_cfg().replace(**{"spec.method": "ngram-gpu", "spec.k": 2})
    eng = Engine(cfg)
    assert eng.mixed is None
    from bubblesim.core.shape import BatchShape

    cm = cost_model.CostModel(cfg.replace(model="llama3.2-1b", device="cuda"))
    mixed = BatchShape(num_reqs=2, num_prefill_reqs=1, prefill_tokens=100, decode_tokens=1)
    assert not cm.graphed(mixed, True)
    plain = cost_model.CostModel(make_cfg(model="llama3.2-1b", device="cuda"))
    assert plain.graphed(mixed, True)


# ---- the flat attention grid (Triton interpreter) ---------------------------------------------
@pytest.mark.skipif(INTERPRET, reason="this is the interpreter run")
def test_flat_grid_under_interpreter():
    pytest.importorskip("triton")
    helpers.run_interpreter_tests(__file__, timeout_s=900)


def _flat_case(shapes, pad_seqs: int, pad_tokens: int, seed: int):
    """A batch padded as a mixed graph pads it: extra sequence rows with no tokens (seq_len 0,
    query_start_loc = the real token count) and tokens in no sequence."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels import make_batch, reference_attention

    q, kc, vc, attn = make_batch(shapes, 4, 2, 16, 4, torch.float32, seed=seed)
    ref = reference_attention(q, kc, vc, attn, 0.25)
    t_real, b = q.shape[0], len(shapes)
    qsl = torch.cat([attn.query_start_loc, torch.full((pad_seqs,), t_real, dtype=torch.int32)])
    seq_lens = torch.cat([attn.seq_lens, torch.zeros(pad_seqs, dtype=torch.int32)])
    tables = torch.cat([attn.block_tables, attn.block_tables[:1].repeat(pad_seqs, 1)])
    padded_q = torch.cat([q, torch.randn(pad_tokens, *q.shape[1:])])
    assert qsl.shape[0] == b + pad_seqs + 1
    return padded_q, kc, vc, qsl, seq_lens, tables, ref, t_real


FLAT_CASES = [  # (num_splits, decode_splits, block_m)
    (1, 1, 16),
    (1, 1, 0),
    (2, 1, 16),  # split-KV per token
    (1, 4, 16),  # one-token rows split, prefill rows whole
]


@interp_only
@pytest.mark.parametrize("splits,decode_splits,block_m", FLAT_CASES)
def test_interp_flat_grid_with_padded_rows_and_tokens(splits, decode_splits, block_m):
    from engine.kernels import paged_attention

    shapes = [(7, 9), (1, 70), (20, 3), (1, 0), (5, 40), (1, 130)]
    q, kc, vc, qsl, seq_lens, tables, ref, t = _flat_case(shapes, 5, 9, seed=splits + block_m)
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, kc, vc, qsl, seq_lens, tables, max_query_len=q.shape[0], max_seq_len=512,
        scale=0.25, out=out, num_splits=splits, decode_splits=decode_splits, block_m=block_m,
        block_n=16, min_tiles=1, flat=True,
    )  # fmt: skip
    err = ((out[:t].double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5


# ---- GPU: the graphs ---------------------------------------------------------------------------
def gpu_cfg(**kw) -> Config:
    base = dict(
        device="cuda", dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=64,
        max_model_len=1024, num_kv_blocks=512,
    )  # fmt: skip
    base.update(kw)
    return make_cfg(**base)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("model", ["tiny", "small"])
def test_gpu_mixed_graph_logits_match_the_eager_step(model):
    """Every mixed step: its graph's logits (kept for the test) against the plain eager
    forward of the same step (bf16 tolerance), and the graph's tokens are its logits' argmax."""
    eng = Engine(gpu_cfg(model=model, cuda_graphs_mixed=False))
    graphs = __import__("engine.mixed_graphs", fromlist=["MixedGraphs"]).MixedGraphs(
        eng.model, eng.kv_cache, eng.inputs, eng.sampler, eng.inputs.max_tokens,
        eng.max_model_len, keep_logits=True,
    )  # fmt: skip
    # the engine's buffers hold max_tokens = 64 tokens, the largest bucket
    graphs.capture()
    eng.mixed = graphs
    forward, checked = eng.forward, []

    def both(step):
        if not step.mixed:
            return forward(step)
        g = step.num_gen
        plain = eng.inputs.attn_views(step.num_reqs, step.bucket, step.bucket, eng.max_model_len)
        graph_logits = forward(step)[:g].clone()  # runs the graph: inputs, forward, sampling
        # the eager forward on the same (now finished) inputs, attention with its own grid;
        # the graph already wrote this step's KV, which the eager forward rewrites identically
        hidden = eng.model(step.input_ids, step.positions, plain, eng.kv_cache)
        eager = eng.model.compute_logits(hidden[step.logits_idx])
        torch.testing.assert_close(graph_logits, eager, atol=2e-2, rtol=2e-2)
        got = graphs.tokens[step.bucket, step.mixed][:g]
        assert torch.equal(got, graph_logits.argmax(-1).int())
        checked.append(step.bucket)
        return None

    eng.forward = both  # type: ignore[method-assign]
    real_fill = eng.inputs.fill

    def fill(batch, states, bucket, width, mixed_rows=0):
        if not batch.shape.is_pure_decode:
            bucket = graphs.bucket_for(batch.shape.num_tokens)
            num_gen = sum(1 for e in batch.entries if e.generates)
            mixed_rows = graphs.rows_for(bucket, num_gen)
        return real_fill(batch, states, bucket, width, mixed_rows)

    eng.inputs.fill = fill  # type: ignore[method-assign]
    reqs = workload(12, seed=4)
    outs = eng.run(reqs, arrival="asap")
    assert [len(o.token_ids) for o in outs] == [r.output_len for r in reqs]
    assert len(checked) > 10 and len(set(checked)) >= 2, checked


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_switch_on_and_off_emit_the_same_greedy_tokens():
    """float32 (bf16 rounding differences between a padded graph step and an eager one can flip
    near-ties of random weights; "small" is not run in float32: its decode graphs' skinny GEMM
    needs more shared memory than an H100 has in float32, with or without this switch);
    chunked prefill, prefix hits, decode rows beside prefill chunks, requests joining mid-run."""
    reqs = workload(14, seed=1)
    cfg = gpu_cfg(model="tiny", dtype="float32")
    off, eng_off, _ = run(cfg.replace(cuda_graphs_mixed=False), reqs)
    on, eng_on, used = run(cfg, reqs, model=eng_off.model)
    assert eng_on.mixed is not None and eng_on.mixed.graphs
    assert len(used) > 10 and len(set(used)) >= 3, used
    assert on == off


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_bf16_forced_tokens_and_penalties():
    sampling = [("temperature", 0.8), ("top_k", 40), ("repetition_penalty", 1.3)]
    reqs = workload(12, seed=5, forced_every=1, history_every=3)
    on, eng, used = run(gpu_cfg(model="small", sampling=sampling), reqs)
    assert len(used) > 5
    for r, toks in zip(reqs, on):
        assert toks == list(r.output_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("depth", [1, 2])
def test_gpu_no_hidden_sync_with_mixed_graphs(depth):
    sys.path.insert(0, str(ROOT / "tests"))
    from sync_debug import steps_without_host_sync

    cfg = gpu_cfg(batches_in_flight=depth).replace(**{"sampling.temperature": 0.7})
    eng = Engine(cfg)
    used: list[int] = []
    fill = eng.inputs.fill

    def spy(*a, **kw):
        step = fill(*a, **kw)
        used.append(step.bucket if step.mixed else 0)
        return step

    eng.inputs.fill = spy  # type: ignore[method-assign]
    steps = steps_without_host_sync(eng, workload(10, seed=6), workload(10, seed=7))
    eng.finish()
    assert steps > 20 and len([b for b in used if b]) > 10
