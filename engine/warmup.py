"""Warm-up: meet every Triton compile the engine's eager steps can select before a measured run.

Triton compiles a kernel once per specialization: its constexprs (block sizes from
next_power_of_2, split counts) and, for each runtime argument, an integer's class (== 1, % 16 == 0,
other) and a pointer's 16-byte alignment. A step meets a new one when its shape does, and the
compile (or the load from Triton's disk cache) stalls that step for milliseconds to seconds.
Decode steps replay CUDA graphs captured at start-up, and so do prefill and mixed steps with
`cuda_graphs_mixed` (engine.mixed_graphs: every token bucket up to the step limit is run eagerly
twice before its capture, in Engine.__init__, so its kernels, the flat attention grid's
included, are compiled before any run); the classes below are those of EAGER steps (prefill
chunks, mixed batches, and all-single-token batches that are not a graph's), as the launch
wrappers in engine.kernels choose them:

- `paged_attention` (max_query_len >= 2): BLOCK_M (64 when max_query_len * group > 16, else 16),
  NUM_SPLITS (`choose_num_splits`: only for max_query_len <= 16, from programs = seqs x kv heads
  x query blocks and max_seq_len), DECODE_SPLITS (`choose_decode_splits`: only for
  max_query_len > 16, from max_seq_len), num_tokens' int class; with either split,
  `_reduce_splits_kernel`: the split count, BY_SEQ, num_seqs' and num_tokens' int classes;
- `rope_write_kv` (max_query_len >= 2): the alignment of the positions and slot-mapping views,
  which sit at offsets proportional to the token count in the input buffers (num_tokens % 4);
- `decode_attention` (eager, max_query_len == 1): NUM_SPLITS and BLOCK_N (`decode_num_splits`:
  seqs x kv heads and max_seq_len) and the slot-mapping view's alignment (num_tokens % 4);
- the skinny GEMM for steps of <= SKINNY_MAX_ROWS tokens (rows == 1 is its own class), and for
  logits of <= SKINNY_MAX_ROWS generating rows; `rms_norm`, `silu_mul`: one class each.
cuBLAS picks its kernels per GEMM shape (a first use loads them), so steps of every power-of-two
token count and logits-row count up to the limits are included too.

`step_keys` is that model, `forward_plan` a short list of `WarmupStep`s whose keys cover the keys
of every step the limits allow (a pure function of `Limits`), and `run_forward_plan` runs them
as model forwards on the engine's own input buffers (so every view has the address a real step's
has) with made-up metadata: every sequence's context is its own query tokens, the host bound
max_seq_len is the step's (it only selects the split count), and the slot mapping is -1, so no KV
is written. The kernels of the rest of a step (input finishing, sampling) are met by
`request_plan`: requests through `Engine.add_request`/`step`, one per token-count class.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SKINNY_MAX_ROWS = 4  # engine.model.SKINNY_MAX_ROWS (steps of at most this many rows)
PAGED_MAX_SPLIT_QUERY = 16  # paged_attention splits only for max_query_len <= this
PAGED_MIN_KEYS_PER_SPLIT = 256  # engine.kernels.paged_attention._MIN_KEYS_PER_SPLIT
PAGED_MAX_SPLITS = 16  # paged_attention._MAX_SPLITS
DECODE_MAX_SPLITS = 32  # decode_attention.MAX_SPLITS
DECODE_LONG_SPLIT_KEYS = 4096  # decode_attention.LONG_SPLIT_KEYS
DECODE_MAX_LONG_SPLITS = 8  # decode_attention.MAX_LONG_SPLITS
PROGRAMS_PER_SM = 2  # both wrappers split until this many programs per SM


@dataclass(frozen=True)
class Limits:
    """What bounds an eager step's shape (`Limits.of_engine`). num_sms = 0: no split-KV (CPU)."""

    num_q_heads: int
    num_kv_heads: int
    max_num_seqs: int
    max_tokens: int  # max_num_batched_tokens: tokens of one step
    max_model_len: int
    num_sms: int

    @staticmethod
    def of_engine(engine: Any) -> Limits:
        import torch

        sms = 0
        if engine.device.type == "cuda":
            sms = torch.cuda.get_device_properties(engine.device).multi_processor_count
        cfg = engine.cfg
        spec = engine.model.local  # this rank's heads (tensor parallelism), else the model's
        return Limits(
            num_q_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            max_num_seqs=cfg.max_num_seqs,
            max_tokens=min(cfg.max_num_batched_tokens, engine.inputs.max_tokens),
            max_model_len=engine.max_model_len,
            num_sms=sms,
        )

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class WarmupStep:
    """One eager step: the query tokens of each sequence, the host bound on context length,
    and how many logits rows it computes (generating entries)."""

    query_lens: tuple[int, ...]
    max_seq_len: int
    num_gen: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)


# ---- the model of the launch wrappers --------------------------------------------------------
def p2(n: int) -> int:
    """triton.next_power_of_2 (n >= 1)."""
    return 1 << (n - 1).bit_length()


def int_class(n: int) -> int:
    """Triton's class of an int argument: 1 (a constant), 16 (divisible by 16), 0 (other)."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def paged_block_m(max_query_len: int, group: int) -> int:
    return max(64 if max_query_len * group > 16 else 16, p2(group))


def paged_splits(num_programs: int, max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """engine.kernels.paged_attention.choose_num_splits."""
    if num_sms <= 0 or max_query_len > PAGED_MAX_SPLIT_QUERY:
        return 1
    target = PROGRAMS_PER_SM * num_sms
    if num_programs >= target:
        return 1
    s = min(
        math.ceil(target / num_programs),
        math.ceil(max_seq_len / PAGED_MIN_KEYS_PER_SPLIT),
        PAGED_MAX_SPLITS,
    )
    return 1 if s <= 1 else p2(s)


def paged_decode_splits(max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """engine.kernels.paged_attention.choose_decode_splits."""
    if num_sms <= 0 or max_query_len <= PAGED_MAX_SPLIT_QUERY:
        return 1
    s = min(math.ceil(max_seq_len / DECODE_LONG_SPLIT_KEYS), DECODE_MAX_LONG_SPLITS)
    return 1 if s <= 1 else p2(s)


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int):
    """engine.kernels.decode_attention.decode_num_splits: (splits, keys per tile)."""
    if num_sms <= 0:
        return 1, 64
    programs = num_seqs * num_kv_heads
    target = PROGRAMS_PER_SM * num_sms
    if programs >= target:  # only long sequences split (LONG_SPLIT_KEYS there)
        s = min(math.ceil(max_seq_len / DECODE_LONG_SPLIT_KEYS), DECODE_MAX_LONG_SPLITS)
        return (1 if s <= 1 else p2(s)), 64
    s = min(math.ceil(target / programs), DECODE_MAX_SPLITS)
    block_n = 32 if s >= 16 else 64
    s = min(s, math.ceil(max_seq_len / block_n))
    return (1 if s <= 1 else p2(s)), block_n


def step_keys(step: WarmupStep, lim: Limits) -> frozenset[tuple]:
    """The compile classes an eager step of this shape selects (see the module docstring)."""
    t, b, mq, ms = step.num_tokens, step.num_seqs, step.max_query_len, step.max_seq_len
    keys: set[tuple] = {("rms_norm",)}
    if mq >= 2:
        bm = paged_block_m(mq, lim.group)
        num_q_blocks = math.ceil(mq / (bm // lim.group))
        s = paged_splits(b * lim.num_kv_heads * num_q_blocks, mq, ms, lim.num_sms)
        ds = paged_decode_splits(mq, ms, lim.num_sms) if s == 1 else 1
        keys.add(("paged", bm, s, int_class(t), ds))
        if s > 1 or ds > 1:
            keys.add(("reduce", max(s, ds), ds > 1, int_class(b), int_class(t)))
        keys.add(("rope_write_kv", t % 4))
    else:
        s, block_n = decode_splits(b, lim.num_kv_heads, ms, lim.num_sms)
        keys.add(("decode", s, block_n, t % 4))
    if t <= SKINNY_MAX_ROWS:
        keys.add(("gemm_skinny", t))
    else:
        keys.add(("gemm", p2(t)))
        keys.add(("silu_mul",))
    g = step.num_gen
    if 0 < g <= SKINNY_MAX_ROWS:
        keys.add(("logits_skinny", g))
    elif g:
        keys.add(("logits", p2(g)))
    return frozenset(keys)


# ---- the steps the limits allow, and a plan that covers their keys ------------------------------
def _spread(total: int, num_seqs: int, first: int) -> tuple[int, ...]:
    """`num_seqs` query lengths summing to `total`, the first `first`, none above it or below 1
    (needs num_seqs - 1 <= total - first <= (num_seqs - 1) * first)."""
    rest, n = total - first, num_seqs - 1
    out = [first]
    for i in range(n):
        q = rest // (n - i)
        out.append(q)
        rest -= q
    return tuple(out)


def _token_reps(lo: int, hi: int) -> list[int]:
    """The smallest token count in [lo, hi] of each class step_keys tells apart for one shape
    (count % 4, int class, the exact count up to SKINNY_MAX_ROWS)."""
    seen: dict[tuple[int, int, int], int] = {}
    for t in range(lo, min(hi, lo + 32) + 1):  # 32 consecutive counts hold every class
        cls = (t % 4, int_class(t), t if t <= SKINNY_MAX_ROWS else 0)
        seen.setdefault(cls, t)
    return sorted(seen.values())


def _split_reps(split_of, lo: int, hi: int, first_bound) -> list[int]:
    """The smallest max_seq_len in [lo, hi] for each split value `split_of(max_seq_len)` takes;
    the value only changes where ceil(max_seq_len / bound) does (`first_bound` of a count c)."""
    reps: dict[Any, int] = {}
    c = 1
    while True:
        ms = max(lo, first_bound(c))
        if ms > hi:
            break
        reps.setdefault(split_of(ms), ms)
        c += 1
        if c > DECODE_MAX_SPLITS + 1:  # past every cap: the value no longer changes
            break
    return sorted(reps.values())


def candidate_steps(lim: Limits) -> Iterator[WarmupStep]:
    """Representatives of every eager step the limits allow, cheapest first within each family:
    together their keys are the keys of all such steps (tests check this against random ones)."""
    t_max, mml = lim.max_tokens, lim.max_model_len
    b_max = min(lim.max_num_seqs, t_max)
    # all-single-token batches: decode_attention, logits of b rows
    kv = lim.num_kv_heads
    for b in range(1, b_max + 1):
        for ms in _split_reps(
            lambda m, b=b: decode_splits(b, kv, m, lim.num_sms),
            1,
            mml,
            lambda c: 32 * (c - 1) + 1,  # tiles of 32 or 64 keys: every bound of either
        ):
            yield WarmupStep((1,) * b, ms, b)
    # a longest query of 2..16 tokens: the split range of paged attention
    target = PROGRAMS_PER_SM * max(lim.num_sms, 1)
    b_hi = min(b_max, math.ceil(target / lim.num_kv_heads) + 32)
    for mq in range(2, min(PAGED_MAX_SPLIT_QUERY, mml, t_max) + 1):
        bm = paged_block_m(mq, lim.group)
        nqb = math.ceil(mq / (bm // lim.group))
        for b in range(1, b_hi + 1):
            lo, hi = mq + b - 1, min(b * mq, t_max)
            if lo > hi:
                break
            programs = b * lim.num_kv_heads * nqb
            for ms in _split_reps(
                lambda m, mq=mq, programs=programs: paged_splits(programs, mq, m, lim.num_sms),
                mq,
                mml,
                lambda c: PAGED_MIN_KEYS_PER_SPLIT * (c - 1) + 1,
            ):
                for t in _token_reps(lo, hi):
                    yield WarmupStep(_spread(t, b, mq), ms, b)
    # longer queries with long contexts: decode splits (one-token rows), by sequence count class
    if lim.num_sms > 0:
        for ms in _split_reps(
            lambda m: paged_decode_splits(PAGED_MAX_SPLIT_QUERY + 1, m, lim.num_sms),
            PAGED_MAX_SPLIT_QUERY + 1,
            mml,
            lambda c: DECODE_LONG_SPLIT_KEYS * (c - 1) + 1,
        ):
            for b in (1, 2, 16):
                if b > b_max:
                    continue
                for t in _token_reps(PAGED_MAX_SPLIT_QUERY + b, t_max):
                    yield WarmupStep(_spread(t, b, t - b + 1), ms, b)
    # longer queries (no split): one sequence, or as few as max_model_len allows
    longer = [*_token_reps(PAGED_MAX_SPLIT_QUERY + 1, t_max)]
    longer += [1 << k for k in range(5, t_max.bit_length())] + [t_max]
    for t in sorted(set(longer)):
        if t <= PAGED_MAX_SPLIT_QUERY or t > t_max:
            continue
        n = math.ceil(t / mml)
        if n > lim.max_num_seqs:
            continue
        first = min(t - (n - 1), mml)
        yield WarmupStep(_spread(t, n, first), first, n)


def forward_plan(lim: Limits) -> list[WarmupStep]:
    """A deterministic list of steps whose keys cover those of every candidate: each key's
    first (cheapest) witness, taken in key order unless an earlier pick covered the key."""
    witness: dict[tuple, tuple[WarmupStep, frozenset[tuple]]] = {}
    for step in candidate_steps(lim):
        keys = step_keys(step, lim)
        for k in keys:
            witness.setdefault(k, (step, keys))
    covered: set[tuple] = set()
    plan: list[WarmupStep] = []
    for k in sorted(witness, key=repr):
        if k in covered:
            continue
        step, keys = witness[k]
        plan.append(step)
        covered |= keys
    return plan


def plan_keys(plan: list[WarmupStep], lim: Limits) -> set[tuple]:
    out: set[tuple] = set()
    for step in plan:
        out |= step_keys(step, lim)
    return out


def request_plan(
    max_tokens: int, max_model_len: int, max_num_seqs: int, depth: int
) -> list[list[tuple[int, int]]]:
    """Rounds of (prompt_len, output_len) requests, each round added at once and run to the
    end, for the per-step kernels outside the model (input finishing: a next_power_of_2 block up
    to 1024, the token count's int class and views at offsets proportional to it; speculative
    decoding's input correction: the row count's int class) and for cuBLAS shapes:
    - one request per round, prompts of every count up to 12 and of 2^k - 1, 2^k, 2^k + 1 .. + 4
      up to max_tokens: each prefill is an eager step of exactly that many tokens; output
      lengths cycle through 2 .. depth + 1, so prefills land on every ring slot of the inputs;
    - then min(16, max_num_seqs) requests together with outputs 2 .. 17: decode steps of every
      row count from 16 down to 1."""
    cap = min(max_tokens, max_model_len - depth - 1)
    counts = set(range(1, 13))
    k = 16
    while k // 2 <= cap:
        counts |= {k - 1, k, k + 1, k + 2, k + 3, k + 4}
        k *= 2
    counts.add(cap)
    lens = sorted(c for c in counts if 1 <= c <= cap)
    rounds = [[(p, 2 + i % depth)] for i, p in enumerate(lens)]
    n = min(16, max_num_seqs, max_tokens // 8)
    if n > 1 and max_model_len >= 8 + n + 17:
        rounds.append([(8 + i, 2 + i) for i in range(n)])
    return rounds


# ---- running a plan ------------------------------------------------------------------------------
def run_forward_plan(engine: Any, plan: list[WarmupStep], compile_threads: int = 0) -> str:
    """Each step as `model(...)` + `compute_logits` on the engine's input-buffer views with
    made-up metadata; writes no KV (slot mapping -1) and leaves the buffers to the next real
    step, which rewrites what it reads. `compile_threads` > 1 (CUDA): first a dry pass that
    only compiles, `compile_threads` kernels at a time (`compile_in_parallel`); it is only a
    speed-up, so where it fails the real pass compiles one kernel at a time. Returns how the
    compiles ran: "parallel", "serial" or "serial (parallel pass failed: ...)"."""
    import torch

    how = "serial"
    if compile_threads > 1 and engine.device.type == "cuda":
        try:
            how = "parallel" if compile_in_parallel(engine, plan, compile_threads) else how
        except Exception as e:  # noqa: BLE001 - any failure: the serial pass does the work
            how = f"serial (parallel pass failed: {type(e).__name__}: {e})"
    with torch.no_grad():
        for step in plan:
            _forward(engine, step)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return how


def _forward(engine: Any, step: WarmupStep) -> None:
    import torch

    inp, model, dev = engine.inputs, engine.model, engine.device
    b, t = step.num_seqs, step.num_tokens
    attn = inp.attn_views(b, t, step.max_query_len, step.max_seq_len)
    q = torch.tensor(step.query_lens, dtype=torch.int32)
    starts = torch.zeros(b + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(q, 0)
    attn.query_start_loc.copy_(starts)
    attn.seq_lens.copy_(q)  # no context: each sequence attends its own tokens
    attn.block_tables.zero_()
    attn.slot_mapping.fill_(-1)
    pos = inp.positions(t)
    pos.copy_(torch.cat([torch.arange(n, dtype=torch.int32) for n in step.query_lens]))
    ids = inp.input_ids[:t]
    ids.zero_()
    hidden = model(ids, pos, attn, engine.kv_cache)
    if step.num_gen:
        model.compute_logits(hidden[torch.arange(step.num_gen, device=dev)])


def compile_in_parallel(engine: Any, plan: list[WarmupStep], threads: int) -> bool:
    """A dry pass over the plan in which every Triton launch only compiles (`JITFunction.run`
    with warmup=True: the kernel is built, not run; outputs stay unwritten, and nothing reads
    them but later dry kernels and cuBLAS), under `triton.AsyncCompileMode`, so the plan's
    compiles run `threads` at a time instead of one by one; all are done on return. Returns
    False (nothing done) where this Triton lacks AsyncCompileMode."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import triton
    from triton.runtime.jit import JITFunction

    mode = getattr(triton, "AsyncCompileMode", None)
    if mode is None:
        return False
    run = JITFunction.run

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        return run(self, *args, grid=grid, warmup=True, **kw)

    # a kernel that fails to build is left to the real pass, which raises where it is launched
    with ThreadPoolExecutor(threads) as pool, mode(pool, ignore_errors=True), torch.no_grad():
        JITFunction.run = compile_only  # type: ignore[method-assign]
        try:
            for step in plan:
                _forward(engine, step)
        finally:
            JITFunction.run = run  # type: ignore[method-assign]
    torch.cuda.synchronize()
    return True


def run_request_plan(engine: Any, plan: list[list[tuple[int, int]]], key_base: int) -> int:
    """Each round through add_request/step, to the end (keys key_base, key_base + 1, ...:
    synthetic prompts with no prefix id, so they register no prefix-cache blocks); returns the
    steps taken. A request this config cannot hold (a KV cache too small) is skipped."""
    from engine.requests import RequestInput

    steps = 0
    key = key_base
    for round_ in plan:
        for p, o in round_:
            with contextlib.suppress(ValueError):
                engine.add_request(RequestInput(f"warmup-{key - key_base}", p, o), key=key)
            key += 1
        while engine.has_work:
            engine.step()
            steps += 1
    return steps


__all__ = [
    "Limits",
    "WarmupStep",
    "candidate_steps",
    "forward_plan",
    "plan_keys",
    "compile_in_parallel",
    "request_plan",
    "run_forward_plan",
    "run_request_plan",
    "step_keys",
]
