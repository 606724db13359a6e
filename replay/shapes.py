"""Clean GPU timings of synthetic batches (`python -m replay shapes`), for `replay calibrate`.

A measured run's GPU interval holds kernels alone only when the GPU began the step after the host
had issued all of it (replay.steps, "clean"). An eager step of a small model is launched more
slowly than its kernels run, so nearly none of its mixed steps is clean and calibration falls
back to the roofline. This sweep times the engine's model on a grid of batch shapes with the
launch hidden instead:

    GPU spin (torch.cuda._sleep) | start event | forward + logits | end event     (one stream)

The host enqueues the spin, then issues the whole step while the GPU spins; the start event
fires only once the spin ends. A sample is clean when, after the host has issued the end event,
the start event has still not fired (`Event.query`, which never blocks): then every kernel of
the step was queued before the GPU began it, and end - start is kernel time alone. A sample that
is not clean is retried with a spin twice as long, then dropped and counted. Between the spin
and the end event the host makes no call that waits for the device: every input is on the device
before the spin (pageable copies would wait for the stream), the forward reads no tensor values
on the host ("triton" backend, engine.model), and the logits rows are picked with a device index
tensor. The device is synchronized after each sample. On CPU there is no spin: a sample is the
wall time of a synchronous forward.

What one sample times, per batch kind (the `kind` column):
- mixed (a prefill chunk in the batch; the engine runs these eagerly): `model.forward` over the
  flat batch, then `compute_logits` on one row per request (each sequence's last token), on the
  engine's own input-buffer views (engine.inputs, so addresses and Triton specialisations are a
  real step's), with the bounds an eager step passes (max query length, max sequence length).
- decode (one token per request): on CUDA with config cuda_graphs, the replay of a CUDA graph of
  forward + logits for the batch's bucket, captured as the engine captures its decode graphs
  (engine.graphs, bound max_model_len; column `graph` true), so the timing matches the engine's
  replays; else eagerly, as for mixed batches.
Not timed, unlike a run's step: the input copy and its finishing kernels, and sampling
(`replay calibrate --shapes` reports how clean run steps compare with the sweep).

Each sample's BatchShape is computed as `core.policy.scheduler.Scheduler._shape` does, for
requests whose prefill chunk ends their prompt and that need no history (plus `max_kv_tokens`,
the longest sequence). Every request of a batch gets distinct KV blocks (a seeded permutation of
the cache); a batch that needs more blocks than the cache has reuses them (`kv_wrapped`).

Output: one parquet row per shape (`COLUMNS`; `gpu_ms` is the median of the clean samples),
written atomically, with JSON file metadata under `META_KEY` (model, GPU, dtype, versions, date,
engine commit, config, sample counts). `read_sweeps` reads files back for calibration (numpy and
pyarrow only; torch is imported by the sweep alone).
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.atomic import temp_file
from core.config import Config
from core.shape import SHAPE_FIELDS, BatchShape
from replay.steps import CalibrationError

META_KEY = b"replay.shapes"
FORMAT_VERSION = 1
KINDS = ("decode", "mixed")
EXTRA_SHAPE_FIELDS = ("max_kv_tokens",)  # computed here even before core.shape has them
SHAPE_COLUMNS = (*SHAPE_FIELDS, *(f for f in EXTRA_SHAPE_FIELDS if f not in SHAPE_FIELDS))
COLUMNS = (
    "label",  # which family of the grid (a human hint, never read by calibrate)
    "kind",  # decode | mixed
    *SHAPE_COLUMNS,
    "max_query_len",  # the host bounds the kernels were launched with
    "max_seq_len",
    "graph",  # timed as a CUDA graph replay (decode on CUDA with cuda_graphs)
    "bucket",  # the graph's batch size (0: eager)
    "gpu_ms",  # median over the clean samples
    "gpu_ms_min",
    "gpu_ms_max",
    "repeats",  # clean samples taken
    "unclean",  # samples rejected: the GPU reached the start event before the host was done
    "issue_ms",  # median host time to issue the step (eager: the launch the spin hid)
    "spin_ms",  # median spin enqueued before the step (0 on CPU)
    "kv_blocks",  # KV blocks the batch's requests hold
    "kv_wrapped",  # the cache has fewer blocks: some requests share blocks
)

# ---- the grid -----------------------------------------------------------------------------------
PREFILL_TOKENS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
PRIOR_CONTEXTS = (2048, 8192, 32768)  # tokens already in the cache before a prefill chunk
CHUNK_TOTALS = (512, 2048)  # (+ max_num_batched_tokens) split into 2, 4, 8 fresh chunks
MIXED_PREFILL = (64, 256, 1024, 2048, 4096)  # prefill tokens beside decode rows
MIXED_DECODE_ROWS = (1, 4, 16, 32, 64, 128)
MIXED_DECODE_CONTEXTS = (512, 4096)
LONG_CONTEXTS = (16384, 38000)  # one long decode row among short ones (a reasoning request)
SHORT_CONTEXT = 512
DECODE_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
DECODE_CONTEXTS = (128, 512, 1024, 2048, 4096, 8192, 16384)
SPREAD_CONTEXTS = (128, 8192)  # log-uniform contexts of a "spread" batch
DESIGN_KV_TOKENS = 1 << 18  # a batch's summed context stays under this (fits a 320k-token cache)


@dataclass(frozen=True)
class Entry:
    """One request's share of a synthetic step: `n` query tokens after `start` cached ones."""

    start: int
    n: int
    prefill: bool

    @property
    def seq_len(self) -> int:
        return self.start + self.n


@dataclass(frozen=True)
class Batch:
    label: str
    entries: tuple[Entry, ...]

    @property
    def kind(self) -> str:
        return "mixed" if any(e.prefill for e in self.entries) else "decode"

    @property
    def num_tokens(self) -> int:
        return sum(e.n for e in self.entries)

    @property
    def max_query_len(self) -> int:
        return max(e.n for e in self.entries)

    @property
    def max_seq_len(self) -> int:
        return max(e.seq_len for e in self.entries)


@dataclass(frozen=True)
class Limits:
    """What bounds a batch: the config's token budget and batch size, the model length."""

    max_tokens: int  # max_num_batched_tokens
    max_seqs: int  # max_num_seqs
    max_len: int  # max_model_len (the engine's: the config's, or the model's context)

    @staticmethod
    def of(cfg: Config) -> Limits:
        from core.models import get_model

        max_len = cfg.max_model_len or get_model(cfg.model).max_context
        return Limits(cfg.max_num_batched_tokens, cfg.max_num_seqs, max_len)


def batch_shape(entries: Sequence[Entry]) -> dict[str, int]:
    """The BatchShape fields of a synthetic step, as `Scheduler._shape` computes them for
    requests with no prefix-cache hit, no drafts and no history (a prefill chunk starting at 0
    is a new request; a request holds prompt + outputs = start + n tokens), and max_kv_tokens."""
    n_pf = pf_tok = dec_tok = kv = pairs = ctx = new = 0
    longest = 0
    for e in entries:
        n, s = e.n, e.start
        if e.prefill:
            n_pf += 1
            pf_tok += n
            if s == 0:
                new += 1
        else:
            dec_tok += n
        kv += s + n
        pairs += n * s + n * (n + 1) // 2
        ctx += s + n
        longest = max(longest, s + n)
    shape = {
        "num_reqs": len(entries),
        "num_prefill_reqs": n_pf,
        "prefill_tokens": pf_tok,
        "decode_tokens": dec_tok,
        "draft_tokens": 0,
        "kv_read_tokens": kv,
        "attn_pairs": pairs,
        "history_tokens": 0,
        "context_tokens": ctx,
        "new_reqs": new,
        "finished_reqs": 0,
        "max_kv_tokens": longest,
    }
    known = {f: shape.get(f, 0) for f in SHAPE_FIELDS}
    BatchShape(**known)  # a field added to BatchShape without a value here: 0, and it shows up
    return {**known, **{f: shape[f] for f in SHAPE_COLUMNS if f not in known}}


class _Grid:
    def __init__(self, lim: Limits, seed: int) -> None:
        self.lim = lim
        self.rng = np.random.default_rng(seed)
        self.batches: list[Batch] = []
        self._seen: set[tuple[Entry, ...]] = set()

    def add(self, label: str, entries: Sequence[Entry]) -> None:
        """Keep a batch the engine could schedule (token budget, batch size, model length)."""
        entries = tuple(entries)
        lim = self.lim
        if not entries or sum(e.n for e in entries) > lim.max_tokens:
            return
        if len(entries) > lim.max_seqs or any(e.seq_len > lim.max_len for e in entries):
            return
        if sum(e.seq_len for e in entries) > DESIGN_KV_TOKENS:
            return
        if any(e.n < 1 or e.start < 0 or (e.prefill and e.n < 2) for e in entries):
            return
        if entries not in self._seen:  # `_seen` is only tested, never iterated
            self._seen.add(entries)
            self.batches.append(Batch(label, entries))

    def contexts(self, count: int, lo: int, hi: int) -> list[int]:
        """`count` log-uniform context lengths in [lo, hi] (seeded), scaled down to sum to at
        most DESIGN_KV_TOKENS / 2 (a prefill chunk may come beside them)."""
        hi = min(hi, self.lim.max_len)
        lo = min(lo, hi)
        x = np.exp(self.rng.uniform(math.log(lo), math.log(hi), count))
        x *= min(1.0, DESIGN_KV_TOKENS / 2 / x.sum())
        return [int(v) for v in np.clip(np.round(x), 2, hi)]


def _dec(ctx: int) -> Entry:
    return Entry(ctx - 1, 1, False)


def grid(lim: Limits, kinds: Sequence[str] = KINDS, seed: int = 0) -> list[Batch]:
    """The synthetic batches of a sweep, mixed ones first; a pure function of its arguments."""
    g = _Grid(lim, seed)
    t_max, b_max, l_max = lim.max_tokens, lim.max_seqs, lim.max_len

    def upto(values: Sequence[int], hi: int, and_hi: bool = True) -> list[int]:
        top = {hi} if and_hi and hi >= min(values) else set()
        return sorted({v for v in values if v <= hi} | top)

    def priors(p: int) -> list[int]:
        fit = [s for s in PRIOR_CONTEXTS if s + p <= l_max]
        return fit or ([(l_max - p) // 2] if l_max - p >= 32 else [])

    def long_ctx() -> list[int]:
        return sorted({min(c, l_max) for c in LONG_CONTEXTS})

    if "mixed" in kinds:
        for p in upto(PREFILL_TOKENS, t_max):  # one fresh prefill
            g.add("prefill", [Entry(0, p, True)])
        for p in sorted({min(p, t_max) for p in (256, 1024, 2048, t_max)}):  # a later chunk
            for s in priors(p):
                g.add("prefill@ctx", [Entry(s, p, True)])
        for total in sorted({min(p, t_max) for p in (*CHUNK_TOTALS, t_max)}):
            for k in (2, 4, 8):
                g.add("chunks", [Entry(0, total // k, True)] * k)
        for total in sorted({min(p, t_max) for p in (1024, 4096)}):  # a new and a later chunk
            for s in priors(total // 2)[:1]:
                g.add("chunks@ctx", [Entry(0, total // 2, True), Entry(s, total // 2, True)])
        for p in MIXED_PREFILL:
            for d in MIXED_DECODE_ROWS:
                for c in MIXED_DECODE_CONTEXTS:
                    if d >= b_max or d * c > DESIGN_KV_TOKENS:
                        continue
                    pf = min(p, t_max - d)
                    g.add("prefill+decode", [Entry(0, pf, True), *[_dec(c)] * d])
        for p in (256, 2048):
            for d in (16, 64):
                for c in long_ctx():
                    pf = min(p, t_max - d)
                    rows = [_dec(SHORT_CONTEXT)] * (d - 1) + [_dec(c)]
                    g.add("prefill+decode+long", [Entry(0, pf, True), *rows])
        for p in (512, 2048):
            for d in (32, 128):
                pf = min(p, t_max - d)
                rows = [_dec(c) for c in g.contexts(d, *SPREAD_CONTEXTS)]
                g.add("prefill+decode(spread)", [Entry(0, pf, True), *rows])
    if "decode" in kinds:
        for b in upto(DECODE_BATCHES, b_max):
            for c in upto(DECODE_CONTEXTS, l_max, and_hi=False):
                if b * c <= DESIGN_KV_TOKENS:
                    g.add("decode", [_dec(c)] * b)
        for b in (8, 32, 96, 128):
            for c in long_ctx():
                g.add("decode+long", [_dec(SHORT_CONTEXT)] * (b - 1) + [_dec(c)])
        for b in (16, 64, 128, 256):
            g.add("decode(spread)", [_dec(c) for c in g.contexts(b, *SPREAD_CONTEXTS)])
    order = {k: i for i, k in enumerate(("mixed", "decode"))}
    return sorted(g.batches, key=lambda b: order[b.kind])  # stable: grid order within a kind


def quick_grid(batches: Sequence[Batch], per_kind: int) -> list[Batch]:
    """About `per_kind` batches of each kind, spread over the grid (tests, smoke runs)."""
    out: list[Batch] = []
    for kind in ("mixed", "decode"):
        mine = [b for b in batches if b.kind == kind]
        if mine:
            step = max(1, len(mine) // per_kind)
            out.extend(mine[::step])
    return out


# ---- timing -------------------------------------------------------------------------------------
SPIN_MARGIN = 1.5  # spin = margin x the longest recent issue time + pad
SPIN_PAD_MS = 0.5
SPIN_TRIES = 3  # a sample that is not clean is retried with twice the spin, this many times
ISSUE_HISTORY = 8  # issue times remembered per path (eager / graph)
LONG_SAMPLE_MS = 50.0  # shapes whose first sample takes longer get at most LONG_REPEATS
LONG_REPEATS = 3
SPIN_CAL_CYCLES = 10_000_000


@dataclass
class Sample:
    gpu_ms: float
    issue_ms: float
    spin_ms: float


@dataclass
class Timer:
    """CUDA: spin + events on the current stream, clean check by `Event.query`; CPU: wall
    time around a synchronous call."""

    cuda: bool
    cycles_per_ms: float = 0.0
    issue: dict[str, list[float]] = field(default_factory=dict)
    spin_s: float = 0.0  # GPU time spent spinning (sweep cost accounting)

    @staticmethod
    def create(cuda: bool) -> Timer:
        t = Timer(cuda)
        if cuda:
            t.cycles_per_ms = t._calibrate()
        return t

    def _calibrate(self) -> float:
        """Spin cycles per ms on this GPU (median of 3)."""
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # first launch of the kernel: loads it
        rates = []
        for _ in range(3):
            torch.cuda.synchronize()
            start.record()
            torch.cuda._sleep(SPIN_CAL_CYCLES)
            end.record()
            end.synchronize()
            rates.append(SPIN_CAL_CYCLES / start.elapsed_time(end))
        return float(np.median(rates))

    def issue_estimate(self, path: str) -> float | None:
        h = self.issue.get(path)
        return max(h) if h else None

    def note_issue(self, path: str, issue_ms: float) -> None:
        h = self.issue.setdefault(path, [])
        h.append(issue_ms)
        del h[:-ISSUE_HISTORY]

    def sample(self, fn: Callable[[], Any], path: str) -> tuple[Sample | None, int]:
        """One clean sample of `fn` (or None after SPIN_TRIES + 1 unclean ones) and the number
        of unclean tries. `fn` must enqueue device work only (module docstring)."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
            return Sample(ms, ms, 0.0), 0
        import torch

        est = self.issue_estimate(path)
        assert est is not None, "seed the issue estimate first (Timer.measure_issue)"
        spin_ms = SPIN_MARGIN * est + SPIN_PAD_MS
        stream = torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        unclean = 0
        for _ in range(SPIN_TRIES + 1):
            torch.cuda.synchronize()  # the stream is idle: the spin starts now
            torch.cuda._sleep(int(spin_ms * self.cycles_per_ms))
            start.record(stream)
            t0 = time.perf_counter()
            fn()
            end.record(stream)
            issue_ms = (time.perf_counter() - t0) * 1e3
            early = start.query()  # never blocks: True = the GPU began before the host was done
            end.synchronize()
            torch.cuda.synchronize()
            self.spin_s += spin_ms / 1e3
            self.note_issue(path, issue_ms)
            if not early:
                return Sample(start.elapsed_time(end), issue_ms, spin_ms), unclean
            unclean += 1
            spin_ms = 2 * max(spin_ms, SPIN_MARGIN * issue_ms + SPIN_PAD_MS)
        return None, unclean

    def measure_issue(self, fn: Callable[[], Any], path: str) -> None:
        """Seed the path's issue estimate: host time to issue `fn` (after a warm-up call)."""
        t0 = time.perf_counter()
        fn()
        self.note_issue(path, (time.perf_counter() - t0) * 1e3)
        if self.cuda:
            import torch

            torch.cuda.synchronize()


# ---- the model, the cache and the inputs --------------------------------------------------------
class Bench:
    """The engine's model for a config (random weights for a preset), a KV cache, the engine's
    input buffers, and (CUDA with cuda_graphs) decode graphs of forward + logits."""

    def __init__(self, cfg: Config, batches: Sequence[Batch]) -> None:
        import torch

        from engine.engine import build_model, engine_dtype
        from engine.graphs import DecodeGraphs
        from engine.inputs import InputBuffers
        from engine.model import allocate_kv_cache

        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("config key 'device': cuda, but no CUDA device is available")
        lim = Limits.of(cfg)
        self.max_len = lim.max_len
        self.model = build_model(cfg, lim.max_len)
        self.spec = self.model.spec
        self.dtype = engine_dtype(cfg)
        bs = self.block_size = cfg.block_size
        s = cfg.max_num_seqs
        max_blocks = -(-lim.max_len // bs)
        last = torch.zeros(s + 1, dtype=torch.int32, device=self.device)
        self.inputs = InputBuffers(1, s, max(cfg.max_num_batched_tokens, s), max_blocks, bs, last)
        need = max((self.blocks_needed(b) for b in batches), default=1)
        self.num_kv_blocks = cfg.num_kv_blocks if cfg.num_kv_blocks > 0 else need
        self.kv_cache = allocate_kv_cache(
            self.spec, self.num_kv_blocks, bs, self.model.dtype, self.device
        )
        self.perm = np.random.default_rng(cfg.seed).permutation(self.num_kv_blocks)
        self.ids_rng = np.random.default_rng(cfg.seed + 1)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and cfg.cuda_graphs:
            self.graphs = DecodeGraphs(
                self.model, self.kv_cache, self.inputs, s, lim.max_len, 1, None
            )
            self.graphs.capture()

    def blocks_needed(self, batch: Batch) -> int:
        return sum(-(-e.seq_len // self.cfg.block_size) for e in batch.entries)

    def bucket(self, batch: Batch) -> int:
        """The decode graph a batch replays in the engine (0: eager)."""
        if self.graphs is None or batch.kind != "decode":
            return 0
        return self.graphs.bucket_for(len(batch.entries))

    def load(self, batch: Batch) -> tuple[Callable[[], Any], int, bool]:
        """Write the batch into the input buffers and return the step to time (it enqueues
        device work only), its graph bucket (0: eager) and whether the KV blocks wrapped."""
        import torch

        from engine.inputs import LOGITS_IDX, QSL, SEQ_LENS

        inp, bs, dev = self.inputs, self.block_size, self.device
        entries = batch.entries
        b, t_real = len(entries), batch.num_tokens
        bucket = self.bucket(batch)
        t = bucket or t_real
        nb = [-(-e.seq_len // bs) for e in entries]
        wrapped = sum(nb) > self.num_kv_blocks
        flat = self.perm[np.arange(sum(nb)) % self.num_kv_blocks]
        tables = np.split(flat, np.cumsum(nb)[:-1])
        ids = np.zeros(t, np.int32)
        pos = np.zeros(t, np.int32)
        smap = np.full(t, -1, np.int32)
        ids[:t_real] = self.ids_rng.integers(0, self.spec.vocab_size, t_real)
        qsl = np.zeros(b + 1, np.int32)
        tok = 0
        for i, (e, table) in enumerate(zip(entries, tables)):
            p = np.arange(e.start, e.seq_len)
            pos[tok : tok + e.n] = p
            smap[tok : tok + e.n] = table[p // bs] * bs + p % bs
            tok += e.n
            qsl[i + 1] = tok
        rows = torch.zeros(inp.d_rows.shape, dtype=torch.int32)
        rows[QSL, : b + 1] = torch.from_numpy(qsl)
        rows[QSL, b + 1 :] = t_real  # padded graph rows own no query tokens
        rows[SEQ_LENS, :b] = torch.tensor([e.seq_len for e in entries], dtype=torch.int32)
        rows[LOGITS_IDX, :b] = torch.from_numpy(qsl[1:] - 1)  # each sequence's last token
        tab = np.zeros((max(b, bucket), inp.batch_tables.shape[1]), np.int32)
        for i, table in enumerate(tables):
            tab[i, : len(table)] = table
        # every input on the device before timing (a pageable copy would wait for the stream)
        inp.d_rows.copy_(rows)
        inp.d_toks[: 3 * t].copy_(torch.from_numpy(np.concatenate([ids, pos, smap])))
        inp.input_ids[:t].copy_(torch.from_numpy(ids))
        inp.batch_tables[: len(tab)].copy_(torch.from_numpy(tab))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if bucket:
            graphs = self.graphs
            assert graphs is not None

            def replay() -> Any:
                return graphs.replay(bucket)

            return replay, bucket, wrapped
        model, kv = self.model, self.kv_cache
        attn = inp.attn_views(b, t_real, batch.max_query_len, batch.max_seq_len)
        input_ids, positions = inp.input_ids[:t_real], inp.positions(t_real)
        logits_idx = inp.d_rows[LOGITS_IDX, :b]

        def step() -> Any:
            hidden = model(input_ids, positions, attn, kv)
            return model.compute_logits(hidden[logits_idx])

        return step, 0, wrapped


# ---- the sweep ----------------------------------------------------------------------------------
@dataclass
class SweepResult:
    path: Path
    rows: int
    counts: dict[str, int]  # per kind
    dropped_shapes: int  # no clean sample
    unclean_samples: int
    wrapped_shapes: int
    wall_s: float
    gpu_busy_s: float  # spins + timed steps (+ warm-ups, not counted)
    complete: bool
    meta: dict[str, Any]


def sweep(
    cfg: Config,
    out: str | Path,
    repeats: int = 5,
    kinds: Sequence[str] = KINDS,
    quick: int = 0,
    max_seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> SweepResult:
    """Time every batch of the grid for `cfg`; write the parquet file `out` (atomically).
    `quick` > 0: about that many shapes per kind. `max_seconds`: stop adding shapes after
    that long and write what was timed (metadata `complete: false`)."""
    import torch

    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    t_start = time.monotonic()
    batches = grid(Limits.of(cfg), kinds, cfg.seed)
    if quick:
        batches = quick_grid(batches, quick)
    threads = torch.get_num_threads()
    if cfg.device == "cpu":
        torch.set_num_threads(1)  # as replay run: intra-op threads make CPU timings erratic
    was_enabled = gc.isenabled()
    try:
        bench = Bench(cfg, batches)
        timer = Timer.create(bench.device.type == "cuda")
        gc.collect()
        gc.disable()  # a collection inside a host issue would only cost a retry
        with torch.no_grad():
            rows, stats = _time_all(bench, timer, batches, repeats, t_start, max_seconds, progress)
    finally:
        if was_enabled:
            gc.enable()
        torch.set_num_threads(threads)
    meta = _metadata(cfg, bench, timer, stats, time.monotonic() - t_start)
    path = write_sweep(out, rows, meta)
    counts = {k: sum(1 for r in rows if r["kind"] == k) for k in KINDS}
    return SweepResult(
        path=path,
        rows=len(rows),
        counts=counts,
        dropped_shapes=stats["dropped_shapes"],
        unclean_samples=stats["unclean_samples"],
        wrapped_shapes=stats["kv_wrapped_shapes"],
        wall_s=time.monotonic() - t_start,
        gpu_busy_s=stats["gpu_busy_s"],
        complete=stats["complete"],
        meta=meta,
    )


def _time_all(
    bench: Bench,
    timer: Timer,
    batches: Sequence[Batch],
    repeats: int,
    t_start: float,
    max_seconds: float | None,
    progress: Callable[[str], None] | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    stats: dict[str, Any] = dict(
        shapes=len(batches),
        dropped_shapes=0,
        unclean_samples=0,
        kv_wrapped_shapes=0,
        gpu_busy_s=0.0,
        complete=True,
    )
    for i, batch in enumerate(batches):
        if max_seconds is not None and time.monotonic() - t_start > max_seconds:
            stats["complete"] = False
            break
        if progress is not None:
            progress(f"shape {i + 1}/{len(batches)}: {batch.kind} {batch.label}")
        row = _time_batch(bench, timer, batch, repeats, stats)
        if row is not None:
            rows.append(row)
    stats["gpu_busy_s"] += timer.spin_s
    return rows, stats


def _time_batch(
    bench: Bench, timer: Timer, batch: Batch, repeats: int, stats: dict[str, Any]
) -> dict[str, Any] | None:
    fn, bucket, wrapped = bench.load(batch)
    path = "graph" if bucket else "eager"
    fn()  # warm-up: Triton compiles and cuBLAS loads happen here, untimed
    _sync(bench)
    if timer.cuda and timer.issue_estimate(path) is None:
        timer.measure_issue(fn, path)
    samples: list[Sample] = []
    unclean = 0
    want = repeats
    while len(samples) < want:
        s, bad = timer.sample(fn, path)
        unclean += bad
        if s is None:
            break  # the host could not get ahead of the GPU even with a longer spin
        samples.append(s)
        stats["gpu_busy_s"] += s.gpu_ms / 1e3
        if len(samples) == 1 and s.gpu_ms > LONG_SAMPLE_MS:
            want = min(repeats, LONG_REPEATS)
    stats["unclean_samples"] += unclean
    stats["kv_wrapped_shapes"] += int(wrapped)
    if not samples:
        stats["dropped_shapes"] += 1
        return None
    max_seq = bench.max_len if bucket else batch.max_seq_len  # graphs: the bound captured
    return shape_row(batch, samples, unclean, bucket, max_seq, bench.blocks_needed(batch), wrapped)


def shape_row(
    batch: Batch,
    samples: Sequence[Sample],
    unclean: int,
    bucket: int,
    max_seq_len: int,
    kv_blocks: int,
    kv_wrapped: bool,
) -> dict[str, Any]:
    """A file row (COLUMNS) for a batch and its clean samples."""
    g = np.array([s.gpu_ms for s in samples])
    return {
        "label": batch.label,
        "kind": batch.kind,
        **batch_shape(batch.entries),
        "max_query_len": batch.max_query_len,
        "max_seq_len": max_seq_len,
        "graph": bool(bucket),
        "bucket": bucket,
        "gpu_ms": float(np.median(g)),
        "gpu_ms_min": float(g.min()),
        "gpu_ms_max": float(g.max()),
        "repeats": len(samples),
        "unclean": unclean,
        "issue_ms": float(np.median([s.issue_ms for s in samples])),
        "spin_ms": float(np.median([s.spin_ms for s in samples])),
        "kv_blocks": kv_blocks,
        "kv_wrapped": bool(kv_wrapped),
    }


def _sync(bench: Bench) -> None:
    if bench.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _metadata(
    cfg: Config, bench: Bench, timer: Timer, stats: dict[str, Any], wall_s: float
) -> dict[str, Any]:
    import torch

    from replay.run import gpu_name

    commit, dirty = _engine_commit()
    return {
        "format": "replay.shapes",
        "version": FORMAT_VERSION,
        "model": cfg.model,
        "gpu": gpu_name(cfg),
        "dtype": cfg.dtype,
        "torch_dtype": str(bench.dtype).removeprefix("torch."),
        "device": cfg.device,
        "attn_backend": bench.model.attn_backend,
        "cuda_graphs": bench.graphs is not None,
        "graph_buckets": list(bench.graphs.buckets) if bench.graphs is not None else [],
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": sys.version.split()[0],
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "engine_commit": commit,
        "engine_dirty": dirty,
        "config": cfg.to_dict(),
        "max_model_len": bench.max_len,
        "num_kv_blocks": bench.num_kv_blocks,
        "spin_cycles_per_ms": timer.cycles_per_ms,
        "timed": "forward + compute_logits (one row per request); decode: CUDA graph of the same "
        "when graph is true; no input copies, no sampling",
        **stats,
        "wall_s": wall_s,
    }


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


def _engine_commit() -> tuple[str | None, bool | None]:
    """HEAD of the repository holding engine/, and whether engine/ or core/ differ from it."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "engine", "core"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head or None, bool(status.strip())


# ---- the file -----------------------------------------------------------------------------------
def _table(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> pa.Table:
    types = {
        "label": pa.string(),
        "kind": pa.string(),
        "graph": pa.bool_(),
        "kv_wrapped": pa.bool_(),
        **{c: pa.float64() for c in COLUMNS if c.endswith("_ms") or c.startswith("gpu_ms")},
    }
    arrays = {c: pa.array([r[c] for r in rows], type=types.get(c, pa.int64())) for c in COLUMNS}
    table = pa.table(arrays)
    return table.replace_schema_metadata({META_KEY: json.dumps(meta, allow_nan=False).encode()})


def write_sweep(path: str | Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """The rows as parquet with `meta` under META_KEY, whole or not at all (temp + rename)."""
    p = Path(path)
    table = _table(rows, meta)
    p.parent.mkdir(parents=True, exist_ok=True)
    with temp_file(p) as tmp:  # follows the umask; removed on failure
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, p)
    return p


@dataclass
class SweepRows:
    """The rows of one or more sweep files, as columns for fitting (replay.calibrate)."""

    cols: dict[str, np.ndarray]  # SHAPE_FIELDS (+ max_kv_tokens if present), num_tokens, intercept
    gpu_ms: np.ndarray
    decode: np.ndarray  # bool: a pure-decode batch
    graph: np.ndarray  # bool: timed as a CUDA graph replay
    file: np.ndarray  # index into paths
    paths: list[str]
    meta: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.gpu_ms)


def read_sweep(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A sweep file's columns and metadata; CalibrationError naming the file and the problem."""
    p = Path(path)
    where = f"shapes file '{p}'"
    if not p.is_file():
        raise CalibrationError(f"{where} does not exist")
    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as e:
        raise CalibrationError(f"{where}: not a parquet file ({e})") from None
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise CalibrationError(f"{where}: not written by `replay shapes` (no {META_KEY.decode()})")
    meta = json.loads(raw)
    if meta.get("format") != "replay.shapes" or meta.get("version") != FORMAT_VERSION:
        raise CalibrationError(
            f"{where}: format {meta.get('format')!r} version {meta.get('version')!r}, "
            f"expected replay.shapes version {FORMAT_VERSION}"
        )
    required = ("kind", *SHAPE_FIELDS, "graph", "gpu_ms")
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise CalibrationError(
            f"{where}: missing column(s) {missing} (an older sweep? run `replay shapes` again)"
        )
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    if len(table) == 0:
        raise CalibrationError(f"{where}: no rows")
    gpu = cols["gpu_ms"].astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(gpu) | (gpu <= 0))
    if bad.size:
        raise CalibrationError(
            f"{where}: row {int(bad[0])}: gpu_ms {float(gpu[bad[0]])!r} is not > 0"
        )
    kind = cols["kind"].astype(str)
    decode = cols["num_prefill_reqs"] == 0
    wrong = np.flatnonzero((kind != np.where(decode, "decode", "mixed")) | (cols["num_reqs"] < 1))
    if wrong.size:
        i = int(wrong[0])
        raise CalibrationError(
            f"{where}: row {i}: kind {kind[i]!r} does not match num_prefill_reqs "
            f"{int(cols['num_prefill_reqs'][i])} / num_reqs {int(cols['num_reqs'][i])}"
        )
    return cols, meta


def read_sweeps(paths: Sequence[str | Path]) -> SweepRows:
    parts = [read_sweep(p) for p in paths]
    fields = [f for f in SHAPE_COLUMNS if all(f in c for c, _ in parts)]
    cols = {
        f: np.concatenate([c[f] for c, _ in parts]).astype(np.float64)
        for f in dict.fromkeys([*SHAPE_FIELDS, *fields])
    }
    cols["num_tokens"] = cols["prefill_tokens"] + cols["decode_tokens"]
    cols["intercept"] = np.ones(len(cols["num_tokens"]))
    return SweepRows(
        cols=cols,
        gpu_ms=np.concatenate([c["gpu_ms"] for c, _ in parts]).astype(np.float64),
        decode=np.concatenate([c["num_prefill_reqs"] == 0 for c, _ in parts]),
        graph=np.concatenate([c["graph"].astype(bool) for c, _ in parts]),
        file=np.concatenate([np.full(len(c["gpu_ms"]), i) for i, (c, _) in enumerate(parts)]),
        paths=[str(p) for p in paths],
        meta=[m for _, m in parts],
    )
