"""The warm-up's shape enumeration (engine.warmup, pure), its runners on a CPU engine (no state
left behind) and the Triton compile counter (replay.gpu.compiles). No simpy/polars: this file also
runs on the GPU host."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from engine.warmup import (
    Limits,
    WarmupStep,
    candidate_steps,
    decode_splits,
    forward_plan,
    paged_splits,
    plan_keys,
    request_plan,
    step_keys,
)

H100_1B = Limits(32, 8, 256, 8192, 131072, 132)  # llama3.2-1b defaults on an H100
LIMITS = [
    H100_1B,
    Limits(32, 8, 256, 2048, 4096, 132),  # llama3-8b, a short context
    Limits(4, 2, 16, 256, 1024, 132),  # tiny
    Limits(32, 1, 64, 512, 8192, 78),  # one kv head (MQA), a smaller GPU
    Limits(16, 4, 5, 40, 300, 114),  # odd small limits
    Limits(32, 8, 256, 8192, 131072, 0),  # no split-KV (CPU)
]


def random_step(lim: Limits, rng: random.Random) -> WarmupStep | None:
    """An eager step within the limits, biased to where splits and small classes live."""
    b_cap = min(lim.max_num_seqs, lim.max_tokens)
    b = rng.randint(1, min(b_cap, 40)) if rng.random() < 0.7 else rng.randint(1, b_cap)
    r = rng.random()
    if r < 0.3:
        mq = 1
    elif r < 0.75:
        mq = rng.randint(2, 17)
    else:
        mq = rng.randint(2, min(lim.max_tokens, lim.max_model_len))
    mq = min(mq, lim.max_model_len)
    q = [mq] + [rng.randint(1, mq) for _ in range(b - 1)]
    rng.shuffle(q)
    if sum(q) > lim.max_tokens:
        return None
    hi = lim.max_model_len if rng.random() < 0.3 else min(lim.max_model_len, 6000)
    ms = rng.randint(mq, max(mq, hi))
    return WarmupStep(tuple(q), ms, rng.randint(0, b))


@pytest.mark.parametrize("lim", LIMITS, ids=lambda lim: f"{lim}")
def test_forward_plan_covers_every_step_the_limits_allow(lim: Limits):
    plan = forward_plan(lim)
    keys = plan_keys(plan, lim)
    rng = random.Random(7)
    checked = 0
    while checked < 4000:
        step = random_step(lim, rng)
        if step is None:
            continue
        checked += 1
        missing = step_keys(step, lim) - keys
        assert not missing, (step, missing)
    # and every candidate (the enumeration the plan is drawn from)
    for step in candidate_steps(lim):
        assert step_keys(step, lim) <= keys


@pytest.mark.parametrize("lim", LIMITS, ids=lambda lim: f"{lim}")
def test_forward_plan_is_short_deterministic_and_within_limits(lim: Limits):
    plan = forward_plan(lim)
    assert plan == forward_plan(lim)
    assert 0 < len(plan) <= 120
    assert sum(s.num_tokens for s in plan) <= 3 * lim.max_tokens + 5000
    for s in plan:
        assert 1 <= s.num_seqs <= lim.max_num_seqs
        assert s.num_tokens <= lim.max_tokens
        assert min(s.query_lens) >= 1
        assert s.max_query_len <= s.max_seq_len <= lim.max_model_len
        assert 0 <= s.num_gen <= s.num_seqs


def test_step_keys_follow_the_launch_wrappers():
    lim = H100_1B  # group 4, 8 kv heads, 264 programs target
    # 2 sequences, longest query 3 (3 x 4 = 12 rows: BLOCK_M 16), 5 tokens, 4000-key bound:
    # 16 programs -> ceil(264 / 16) = 17 splits, capped by ceil(4000 / 256) = 16 and 16 -> 16
    keys = step_keys(WarmupStep((3, 2), 4000, 2), lim)
    assert ("paged", 16, 16, 0, 1) in keys and ("reduce", 16, False, 0, 0) in keys
    assert ("rope_write_kv", 1) in keys and ("gemm", 8) in keys and ("logits_skinny", 2) in keys
    # a longest query of 17: BLOCK_M 64, no query split; a short context: no decode split
    keys = step_keys(WarmupStep((17, 15), 4096, 1), lim)
    assert ("paged", 64, 1, 16, 1) in keys and not any(k[0] == "reduce" for k in keys)
    # ... a 100k-key bound: one-token rows split 8 ways (4096-key runs, at most 8), merged per
    # sequence (2 sequences, 32 tokens)
    keys = step_keys(WarmupStep((17, 15), 100_000, 1), lim)
    assert ("paged", 64, 1, 16, 8) in keys and ("reduce", 8, True, 0, 16) in keys
    # all single tokens: decode attention, 1 sequence x 8 heads -> 32 splits of 32-key tiles
    keys = step_keys(WarmupStep((1,), 2000, 1), lim)
    assert ("decode", 32, 32, 1) in keys and ("gemm_skinny", 1) in keys
    assert decode_splits(1, 8, 100, 132) == (4, 32)  # ceil(100 / 32) = 4
    assert decode_splits(40, 8, 3000, 132) == (1, 64)  # 320 programs fill the GPU
    assert decode_splits(40, 8, 5000, 132) == (2, 64)  # ... but a 5000-key sequence splits
    assert paged_splits(300, 2, 5000, 132) == 1 and paged_splits(8, 2, 700, 132) == 4
    assert paged_splits(8, 2, 700, 0) == 1  # CPU


def test_request_plan_covers_token_count_classes():
    plan = request_plan(8192, 131072, 256, depth=2)
    singles, together = plan[:-1], plan[-1]
    assert all(len(r) == 1 for r in singles)
    lens = [r[0][0] for r in singles]
    assert lens == sorted(set(lens)) and lens[0] == 1 and lens[-1] == 8192
    for b in (16, 32, 64, 128, 256, 512, 1024):  # resolve-ids blocks: %16 and not, each
        bucket = [p for p in lens if b // 2 < p <= b]
        assert any(p % 16 == 0 for p in bucket) and any(p % 16 for p in bucket), b
        assert {p % 4 for p in bucket} == {0, 1, 2, 3}, b
    assert {r[0][1] for r in singles} == {2, 3}  # outputs cycle: prefills on both ring slots
    assert sorted(o for _, o in together) == list(range(2, 18))  # decodes of 16 .. 1 rows
    short = request_plan(8192, 300, 4, depth=3)
    assert all(p + o <= 300 for r in short for p, o in r) and len(short[-1]) == 4
    assert {r[0][1] for r in short[:-1]} == {2, 3, 4}


# ---- on a CPU engine: the runners leave nothing behind --------------------------------------
SPEC = {"spec.method": "ngram-gpu", "spec.k": 3}


def _cpu_engine(spec: bool = False):
    from bubblesim.core.config import Config
    from engine.engine import Engine

    cfg = Config(model="tiny", device="cpu", max_num_seqs=8, max_num_batched_tokens=64,
                 max_model_len=256, num_kv_blocks=64, gc_freeze=False)  # fmt: skip
    return Engine(cfg.replace(**SPEC) if spec else cfg)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_forward_plan_runs_on_the_engine_buffers_and_writes_no_kv(spec: bool):
    import dataclasses

    import torch

    from engine.warmup import run_forward_plan

    torch.manual_seed(0)
    eng = _cpu_engine(spec)
    eng.kv_cache.normal_()
    before = eng.kv_cache.clone()
    lim = dataclasses.replace(Limits.of_engine(eng), num_sms=132)  # split shapes too
    assert lim.max_tokens == 64 and lim.max_model_len == 256
    plan = forward_plan(lim)
    run_forward_plan(eng, plan)
    assert torch.equal(eng.kv_cache, before)
    assert not eng.has_work and eng.hooks.num_steps == 0


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_request_plan_frees_every_block_and_caches_no_prefix(spec: bool):
    from engine.warmup import run_request_plan

    eng = _cpu_engine(spec)
    plan = request_plan(64, 256, 8, eng.depth)
    steps = run_request_plan(eng, plan, key_base=1 << 30)
    assert steps >= 2 * len(plan)
    blocks = eng.sched.blocks
    assert blocks.num_free == blocks.num_blocks and not blocks.hash_to_block
    assert not eng.has_work and not eng.inflight and len(eng.slots.free) == 8
    assert eng.sched.num_preemptions == 0
    # the trace's requests after it: same tokens as on a fresh engine (keys are their own)
    from engine.requests import RequestInput

    reqs = [RequestInput(f"r{i}", 20 + 7 * i, 5) for i in range(3)]
    fresh = _cpu_engine(spec)
    assert [o.token_ids for o in eng.run(reqs)] == [o.token_ids for o in fresh.run(reqs)]


# ---- the compile counter ----------------------------------------------------------------------
def test_compile_counter_is_not_applicable_without_triton_kernels():
    from replay.gpu.compiles import CompileCounter

    eng = SimpleNamespace(device=SimpleNamespace(type="cpu"), model=SimpleNamespace(kernels=None))
    with CompileCounter.for_engine(eng) as c:
        pass
    s = c.summary()
    assert s["applicable"] is False and s["count"] is None and "cpu" in s["why_not"]


def test_compile_counter_counts_through_tritons_hooks_and_chains_them():
    pytest.importorskip("triton")
    from replay.gpu.compiles import CompileCounter, _hook_slots

    slots = _hook_slots()
    assert slots is not None, "this Triton has no compile hooks"
    obj, pre, post = slots
    seen = []
    setattr(obj, pre, lambda **kw: seen.append(("pre", kw["key"])))
    setattr(obj, post, lambda **kw: seen.append(("post", kw["key"])))
    try:
        with CompileCounter(True) as c:
            fn = SimpleNamespace(module="engine.kernels.x", name="_k")
            for key in ("a", "b", "a"):  # "a" asked twice (asynchronous), built once
                getattr(obj, pre)(key=key, repr="r", fn=fn, compile={}, is_manual_warmup=False,
                                  already_compiled=False)  # fmt: skip
            for key in ("a", "b"):
                getattr(obj, post)(key=key, repr=f"sig-{key}", fn=fn, compile={},
                                   is_manual_warmup=False, already_compiled=False)  # fmt: skip
        s = c.summary()
        assert s["count"] == 2 and s["by_kernel"]["engine.kernels.x._k"]["count"] == 2
        assert [f["signature"] for f in s["first"]] == ["sig-a", "sig-b"]
        assert seen == [("pre", "a"), ("pre", "b"), ("pre", "a"), ("post", "a"), ("post", "b")]
        assert getattr(obj, pre).__name__ == "<lambda>"  # the previous hooks are back
    finally:
        setattr(obj, pre, None)
        setattr(obj, post, None)
