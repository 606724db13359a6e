"""The grid of synthetic batches `replay shapes` times: a pure function of the config's limits.

Families (the `label` column), each a lattice over a few axes, every point a batch the engine
could schedule under the limits (token budget, batch size, model length) whose requests' KV fits
the cache:
- decode: B rows x context c per row (c = the KV each row reads, its new token included): B over
  the decode graph buckets and the midpoints between them, c geometric (x sqrt 2) up to
  `max_context`; with speculative decoding every row verifies k drafts (the engine's graphs).
  Cells whose summed KV exceeds the cache are left out, except the first one past the cache in
  each row of the lattice (the table's bracket at its edge): its requests share blocks
  (`kv_wrapped`);
- verify (spec only): k' = 0..k drafts per row on a coarser B x c; verify(widths): mixed k';
- decode+long, decode(spread): one long row among short ones; log-uniform contexts;
- prefill: one fresh chunk of P tokens, P geometric (x sqrt 2) up to max_num_batched_tokens;
- prefill@ctx: a later chunk of P tokens after S already in the cache (P x S);
- prefill@hit: the same after a prefix-cache hit (a new request: its slot is set up in the step);
- chunks, chunks@ctx: a token total split into 2..16 fresh chunks; a new and a later chunk;
- prefill+decode: a chunk of P tokens beside D decode rows of context c (P x D x c);
- prefill+decode+long, prefill+decode(spread);
- chunks(uneven): chunks of unequal sizes in one step (a long and a short fresh chunk, a later
  chunk beside a fresh one of another size), alone and beside decode rows: the mixed kernel's
  grid is sized by the longest chunk and its last query blocks finish last;
- decode(history): decode cells (B at the graph buckets, c in HISTORY_CONTEXTS) whose every
  row needs its output history (sampling with penalties: the decode graph's penalties variant,
  engine.graphs); decode(history mix): every other row, or one row, with history. Each is a
  decode-family cell with history added, so the pair gives the penalties' cost at one shape;
- decode(mix) (no drafts): B rows whose contexts spread evenly over [m (1 - s), m (1 + s)] around
  a mean m, in a fixed shuffled order, s = 0 included: each spread point has its uniform control
  at the same B and KV in the same sweep, so their difference is the cost of the spread alone
  (how much of the decode tail term, replay.analysis.decodetail, each graph bucket's kernel
  hides); decode(mix desc): its spread points with the longest rows first (an engine's running
  list puts its oldest requests, which have decoded longest, first: their programs are
  dispatched first). Opt-in (MIX_FAMILIES): a full grid leaves both out.

Order: every point has a `level` from its axis indices (0: the first and last value of each
axis; 1: every 4th; 2: every 2nd; 3: the rest; a point's level is its axes' largest: level 0
holds each lattice's corners, levels 0-1 its coarse lattice). The grid is
sorted by level, and within a level the families take turns (one point each, in FAMILIES
order), so a sweep cut short (budget, --points, --max-seconds, SIGTERM) holds points of every
family and the coarse lattices, corners included, before any refinement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from bubblesim.core.config import Config
from bubblesim.core.graph_buckets import decode_buckets
from bubblesim.core.models import get_model
from bubblesim.core.shape import ShapeRow, shape_of

SQRT2 = math.sqrt(2.0)
MIN_DECODE_CONTEXT = 64
MIN_PREFILL_TOKENS = 16
PRIOR_MIN = 512  # the shortest prior context of a later chunk
SHORT_CONTEXT = 512  # the short rows beside a long one
MIXED_DECODE_CONTEXTS = (256, 2048, 16384)  # decode rows beside a prefill chunk
SPREAD_CONTEXTS = (128, 8192)  # log-uniform contexts of a "spread" batch
LONG_CONTEXT = 16384  # a long row among short ones (plus max_context)
CHUNK_SPLITS = (2, 4, 8, 16)
UNEVEN_TOTALS = (1024, 4096, 8192)  # chunks(uneven): tokens of the step's chunks, capped
UNEVEN_ROWS = (0, 16, 64)  # decode rows beside them (context UNEVEN_ROW_CONTEXT)
UNEVEN_ROW_CONTEXT = 2048
UNEVEN_PRIOR = 4096  # the later chunk's cached context
HISTORY_CONTEXTS = (256, 2048, 16384)  # decode(history) cells: contexts of the decode lattice
HISTORY_MIX = ((32, 2048), (128, 2048), (256, 2048))  # decode(history mix): (rows, context)
MIX_MIN_ROWS = 8  # decode(mix): every decode graph bucket from this many rows (the kernel's grid
# is the bucket's: a batch's share of its tail hidden changes from one bucket to the next)
MIX_MEANS = (512, 1024, 2048, 4096)  # decode(mix): mean context
MIX_SPREADS = (0, 50, 95)  # decode(mix): half-width of the contexts, % of the mean
MIX_SEED = 7  # decode(mix)'s row order (its own stream: the grid's seeded draws do not move)
# opt-in families (a full grid leaves them out; `replay shapes --families` names them): their
# uniform controls repeat decode lattice cells, and no fit reads them (reports/fidelity/README.md
# section I: the decode tail term's share per graph bucket, measured)
MIX_FAMILIES = ("decode(mix)", "decode(mix desc)")
FAMILIES = (  # the order within a level
    "decode",
    "prefill",
    "prefill+decode",
    "prefill@ctx",
    "verify",
    "chunks",
    "decode+long",
    "prefill+decode+long",
    "prefill@hit",
    "chunks@ctx",
    "verify(widths)",
    "decode(spread)",
    "prefill+decode(spread)",
    "decode(history)",  # last: the families before keep their turns within a level
    "decode(history mix)",
    "chunks(uneven)",  # added after the others: their points and order are unchanged
    "decode(mix)",  # likewise
    "decode(mix desc)",
)
NO_CACHE_LIMIT = 1 << 62


@dataclass(frozen=True)
class Entry:
    """One request's share of a synthetic step: `n` query tokens after `start` cached ones.
    A decode row feeds its last token and `drafts` draft tokens (n = 1 + drafts). A prefill
    chunk ends its prompt; with start > 0 it is a later chunk of a running request, or with
    `hit` the first chunk of a new one whose first `start` tokens came from the prefix cache."""

    start: int
    n: int
    prefill: bool
    drafts: int = 0
    hit: bool = False
    hist: bool = False  # its sampling needs the output history (penalties)

    @property
    def seq_len(self) -> int:
        return self.start + self.n

    @property
    def is_new(self) -> bool:
        """First scheduled this step (its slot is set up inside the step)."""
        return self.prefill and (self.start == 0 or self.hit)


@dataclass(frozen=True)
class Batch:
    label: str
    entries: tuple[Entry, ...]
    level: int = 0
    axes: tuple[tuple[str, int], ...] = field(default=(), compare=False)  # the lattice point

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

    def blocks(self, block_size: int) -> int:
        return sum(-(-e.seq_len // block_size) for e in self.entries)


@dataclass(frozen=True)
class Limits:
    """What bounds a batch: the config's token budget and batch size, the model length, the
    contexts to sweep, the KV cache (tokens), the drafts per row, the decode graph buckets."""

    max_tokens: int  # max_num_batched_tokens
    max_seqs: int  # max_num_seqs
    max_len: int  # max_model_len (the engine's: the config's, or the model's context)
    max_context: int = 0  # longest context swept (0: max_len)
    kv_tokens: int = NO_CACHE_LIMIT  # the cache: num_kv_blocks x block_size
    spec_k: int = 0  # drafts per decode row (0: no speculative decoding)
    block_size: int = 16
    buckets: tuple[int, ...] = ()  # decode graph batch sizes (empty: engine.graphs' rule)

    @staticmethod
    def of(
        cfg: Config, num_kv_blocks: int = 0, max_context: int = 0, buckets: Sequence[int] = ()
    ) -> Limits:
        """`buckets`: the engine's decode graph sizes (default: engine.graphs' rule for the
        engine's input buffers)."""
        max_len = cfg.max_model_len or get_model(cfg.model).max_context
        k = cfg.spec.k if cfg.spec.enabled else 0
        if not buckets:  # as Engine sizes its graphs: inputs hold max(budget, max_num_seqs)
            rows = max(cfg.max_num_batched_tokens, cfg.max_num_seqs) // (k + 1)
            buckets = decode_buckets(min(cfg.max_num_seqs, rows))
        blocks = num_kv_blocks or cfg.num_kv_blocks
        return Limits(
            max_tokens=cfg.max_num_batched_tokens,
            max_seqs=cfg.max_num_seqs,
            max_len=max_len,
            max_context=min(max_context or max_len, max_len),
            kv_tokens=blocks * cfg.block_size if blocks else NO_CACHE_LIMIT,
            spec_k=k,
            block_size=cfg.block_size,
            buckets=tuple(buckets),
        )

    @property
    def context_cap(self) -> int:
        return min(self.max_context or self.max_len, self.max_len)

    def decode_cap(self, drafts: int) -> int:
        """Longest decode context: the request keeps room for its drafts and one more output
        within max_model_len (replay.gpu.shapes_step gives it drafts + 2 outputs)."""
        return min(self.context_cap, self.max_len - drafts - 1)

    @property
    def prefill_cap(self) -> int:
        """Longest prefill sequence (its request keeps room for one output)."""
        return min(self.context_cap, self.max_len - 1)

    def decode_buckets(self) -> list[int]:
        if self.buckets:
            return list(self.buckets)
        rows = max(self.max_tokens, self.max_seqs) // (self.spec_k + 1)
        return decode_buckets(min(self.max_seqs, rows))


def batch_shape(entries: Sequence[Entry]) -> dict[str, int]:
    """The BatchShape fields of a synthetic step (summed by bubblesim.core.shape.shape_of) for the
    requests replay.gpu.shapes_step builds (a chunk ends its prompt; a decode row's request holds
    start + 1 tokens, one of them a confirmed output: a `hist` decode row has a history of 1).
    replay.gpu.shapes writes the scheduler's own shape; this is the
    grid's view of it (tests check the two agree)."""
    return shape_of(
        ShapeRow(
            e.start,
            e.n,
            e.prefill,
            num_drafts=e.drafts,
            is_new=e.is_new,
            history_tokens=0 if e.prefill else int(e.hist),
            context_tokens=e.start + (e.n if e.prefill else 1),
        )
        for e in entries
    ).as_dict()


# ---- axes ---------------------------------------------------------------------------------------
def geometric(lo: int, hi: int, ratio: float = SQRT2) -> list[int]:
    """lo, lo * ratio, ... (rounded, distinct) below hi, then hi itself; [] when hi < lo."""
    if hi < lo:
        return []
    out, x = [], float(lo)
    while round(x) < hi:
        out.append(int(round(x)))
        x *= ratio
    return sorted(set(out) | {hi})


def batch_axis(buckets: Sequence[int]) -> list[int]:
    """The decode graph buckets and the midpoint of each gap between two of them."""
    out = set(buckets)
    for a, b in zip(buckets, buckets[1:]):
        if b - a >= 2:
            out.add((a + b) // 2)
    return sorted(out)


def axis_level(i: int, n: int) -> int:
    """0: the first and last value of an n-value axis; 1: every 4th; 2: every 2nd; 3: the rest."""
    if i == 0 or i == n - 1:
        return 0
    return 1 if i % 4 == 0 else 2 if i % 2 == 0 else 3


def every(values: Sequence[int], step: int) -> list[int]:
    """Every `step`-th value, the last one included."""
    out = list(values[::step])
    if values and out[-1] != values[-1]:
        out.append(values[-1])
    return out


# ---- the grid -----------------------------------------------------------------------------------
class _Grid:
    def __init__(self, lim: Limits, seed: int) -> None:
        self.lim = lim
        self.rng = np.random.default_rng(seed)
        self.batches: list[Batch] = []
        self._seen: set[tuple] = set()  # batches (or (label, batch)): only tested, never iterated

    def fits(self, entries: Sequence[Entry]) -> bool:
        """A batch the engine could schedule (token budget, batch size, model length)."""
        lim = self.lim
        if not entries or sum(e.n for e in entries) > lim.max_tokens:
            return False
        if len(entries) > lim.max_seqs:
            return False
        for e in entries:
            if e.n < 1 or e.start < 0 or (e.prefill and (e.n < 2 or e.drafts)):
                return False
            cap = lim.prefill_cap if e.prefill else lim.decode_cap(e.drafts)
            if e.seq_len > cap or (not e.prefill and e.n != 1 + e.drafts):
                return False
        return True

    def in_cache(self, entries: Sequence[Entry]) -> bool:
        bs = self.lim.block_size
        return sum(-(-e.seq_len // bs) for e in entries) * bs <= self.lim.kv_tokens

    def add(
        self, label: str, entries: Sequence[Entry], axes: Sequence[tuple[str, int, int, int]] = ()
    ) -> bool:
        """Keep a batch that fits (and whose KV fits the cache unless `wrap`); `axes`:
        (name, value, index, axis length) of its lattice point. Returns whether it was kept."""
        return self._add(label, entries, axes, wrap=False)

    def add_wrapped(self, label: str, entries: Sequence[Entry], axes) -> bool:
        return self._add(label, entries, axes, wrap=True)

    def add_own(self, label: str, entries: Sequence[Entry], axes) -> bool:
        """`add`, its batch unique within `label` only (a family that holds its own controls:
        another family may time the same batch)."""
        return self._add(label, entries, axes, wrap=False, own=True)

    def _add(
        self, label: str, entries: Sequence[Entry], axes, wrap: bool, own: bool = False
    ) -> bool:
        entries = tuple(entries)
        if not self.fits(entries) or (not wrap and not self.in_cache(entries)):
            return False
        key = (label, entries) if own else entries
        if key in self._seen:
            return False
        self._seen.add(key)
        level = max((axis_level(i, n) for _, _, i, n in axes), default=0)
        point = tuple((name, v) for name, v, _, _ in axes)
        self.batches.append(Batch(label, entries, level, point))
        return True

    def contexts(self, count: int, lo: int, hi: int, share: float = 0.5) -> list[int]:
        """`count` log-uniform context lengths in [lo, hi] (seeded), scaled down to sum to at
        most `share` of the cache."""
        hi = min(hi, self.lim.decode_cap(self.lim.spec_k))
        lo = min(lo, hi)
        x = np.exp(self.rng.uniform(math.log(lo), math.log(hi), count))
        x *= min(1.0, share * min(self.lim.kv_tokens, 1 << 40) / x.sum())
        return [int(v) for v in np.clip(np.round(x), 2, hi)]


def decode_row(ctx: int, drafts: int = 0, hist: bool = False) -> Entry:
    """A decode row whose step reads `ctx` tokens of KV (its verified drafts included)."""
    return Entry(ctx - 1 - drafts, 1 + drafts, False, drafts, hist=hist)


def history_rows(entries: Sequence[Entry]) -> int:
    """Rows whose sampling needs the output history (the file's `history_rows`)."""
    return sum(e.hist for e in entries)


def _ax(name: str, values: Sequence[int], v: int) -> tuple[str, int, int, int]:
    return (name, v, list(values).index(v), len(values))


def grid(
    lim: Limits, kinds: Sequence[str] = ("decode", "mixed"), seed: int = 0, mix: bool = False
) -> list[Batch]:
    """The synthetic batches of a sweep, in level order (module docstring); a pure function of
    its arguments. `mix`: with the opt-in decode(mix) families (MIX_FAMILIES)."""
    g = _Grid(lim, seed)
    if "decode" in kinds:
        _decode(g)
    if "mixed" in kinds:
        _mixed(g)
        _uneven_chunks(g)
    if "decode" in kinds and mix:
        _decode_mix(g)
    rank = {f: i for i, f in enumerate(FAMILIES)}
    turn: dict[tuple[int, str], int] = {}  # within a level the families take turns
    keys = []
    for b in g.batches:
        i = turn[b.level, b.label] = turn.get((b.level, b.label), -1) + 1
        keys.append((b.level, i, rank[b.label]))
    order = sorted(range(len(g.batches)), key=keys.__getitem__)
    return [g.batches[i] for i in order]


def _decode(g: _Grid) -> None:
    lim = g.lim
    k = lim.spec_k
    bs_axis = batch_axis(lim.decode_buckets())
    ctx_axis = geometric(MIN_DECODE_CONTEXT, lim.decode_cap(k))
    for b in bs_axis:
        for c in ctx_axis:
            axes = [_ax("batch", bs_axis, b), _ax("context", ctx_axis, c)]
            rows = [decode_row(c, k)] * b
            if not g.add("decode", rows, axes):
                g.add_wrapped("decode", rows, axes)  # the first cell past the cache
                break
    if k:
        coarse_b, coarse_c = every(bs_axis, 4), every(ctx_axis, 2)
        widths = list(range(k + 1))
        for d in widths:
            for b in coarse_b:
                for c in coarse_c:
                    axes = [_ax("drafts", widths, d), _ax("batch", coarse_b, b)]
                    axes.append(_ax("context", coarse_c, c))
                    g.add("verify", [decode_row(c, d)] * b, axes)
        for b in (4, 16, 64, lim.max_seqs):
            for c in (SHORT_CONTEXT, 4096):
                g.add("verify(widths)", [decode_row(c, i % (k + 1)) for i in range(b)])
    for b in (8, 32, 96, 128):
        for long in sorted({min(LONG_CONTEXT, lim.decode_cap(k)), lim.decode_cap(k)}):
            g.add("decode+long", [decode_row(SHORT_CONTEXT, k)] * (b - 1) + [decode_row(long, k)])
    for b in (16, 64, 128, 256):
        g.add("decode(spread)", [decode_row(c, k) for c in g.contexts(b, *SPREAD_CONTEXTS)])
    _history(g, bs_axis, ctx_axis)


def _history(g: _Grid, bs_axis: Sequence[int], ctx_axis: Sequence[int]) -> None:
    """decode(history), decode(history mix): decode-family cells in the cache (their pair
    without history is in the grid) with history rows."""
    k = g.lim.spec_k
    buckets = [b for b in g.lim.decode_buckets() if b <= g.lim.max_seqs]
    contexts = [c for c in HISTORY_CONTEXTS if c in ctx_axis]
    for b in buckets:
        for c in contexts:
            axes = [_ax("batch", buckets, b), _ax("context", contexts, c)]
            if g.in_cache([decode_row(c, k)] * b) and b in bs_axis:
                g.add("decode(history)", [decode_row(c, k, hist=True)] * b, axes)
    for b, c in HISTORY_MIX:
        if b > g.lim.max_seqs or c not in ctx_axis or not g.in_cache([decode_row(c, k)] * b):
            continue
        g.add("decode(history mix)", [decode_row(c, k, hist=i % 2 == 0) for i in range(b)])
        g.add("decode(history mix)", [decode_row(c, k, hist=i == 0) for i in range(b)])


def _mixed(g: _Grid) -> None:
    lim = g.lim
    t_max, k = lim.max_tokens, lim.spec_k
    p_axis = geometric(MIN_PREFILL_TOKENS, min(t_max, lim.prefill_cap))
    for p in p_axis:
        g.add("prefill", [Entry(0, p, True)], [_ax("tokens", p_axis, p)])
    p_coarse = geometric(64, min(t_max, lim.prefill_cap), 4.0)
    for p in p_coarse:
        s_axis = geometric(PRIOR_MIN, lim.prefill_cap - p, 2.0)
        for s in s_axis:
            axes = [_ax("tokens", p_coarse, p), _ax("prior", s_axis, s)]
            g.add("prefill@ctx", [Entry(s, p, True)], axes)
    for p in sorted({min(256, t_max), min(2048, t_max)}):
        for s in sorted({min(2048, lim.prefill_cap - p), min(16384, lim.prefill_cap - p)}):
            if s > 0:
                g.add("prefill@hit", [Entry(s, p, True, hit=True)])
    totals = sorted({min(512, t_max), min(2048, t_max), t_max})
    for total in totals:
        for n in CHUNK_SPLITS:
            axes = [_ax("tokens", totals, total), _ax("chunks", CHUNK_SPLITS, n)]
            g.add("chunks", [Entry(0, total // n, True)] * n, axes)
    for total in sorted({min(1024, t_max), min(4096, t_max)}):
        s = min(4096, lim.prefill_cap - total // 2)
        if s > 0:
            g.add("chunks@ctx", [Entry(0, total // 2, True), Entry(s, total // 2, True)])
    q = 1 + k
    p_mix = sorted({min(p, t_max) for p in (16, 64, 256, 1024, 4096, t_max)})
    d_axis = sorted({d for d in (1, 4, 16, 64, lim.max_seqs - 1) if 1 <= d < lim.max_seqs})
    c_axis = sorted({min(c, lim.decode_cap(k)) for c in MIXED_DECODE_CONTEXTS})
    for p in p_mix:
        for d in d_axis:
            for c in c_axis:
                pf = min(p, t_max - d * q)
                axes = [_ax("tokens", p_mix, p), _ax("rows", d_axis, d)]
                axes.append(_ax("context", c_axis, c))
                g.add("prefill+decode", [*[decode_row(c, k)] * d, Entry(0, pf, True)], axes)
    for p in (256, 2048):
        for d in (16, 64):
            for long in sorted({min(LONG_CONTEXT, lim.decode_cap(k)), lim.decode_cap(k)}):
                pf = min(p, t_max - d * q)
                rows = [decode_row(SHORT_CONTEXT, k)] * (d - 1) + [decode_row(long, k)]
                g.add("prefill+decode+long", [*rows, Entry(0, pf, True)])
    for p in (512, 2048):
        for d in (32, 128):
            pf = min(p, t_max - d * q)
            rows = [decode_row(c, k) for c in g.contexts(d, *SPREAD_CONTEXTS)]
            g.add("prefill+decode(spread)", [*rows, Entry(0, pf, True)])


def mix_contexts(rows: int, mean: int, spread_pct: int) -> list[int]:
    """decode(mix)'s contexts: `rows` values evenly over [mean (1 - s), mean (1 + s)] (s =
    spread_pct / 100; their mean is `mean`), at least 2, in a fixed shuffled order (the engine's
    batch order is the requests', not their contexts')."""
    half = mean * spread_pct / 100
    ctx = np.linspace(mean - half, mean + half, rows) if rows > 1 else np.array([mean])
    order = np.random.default_rng((MIX_SEED, rows, mean, spread_pct)).permutation(rows)
    return [max(2, int(round(c))) for c in ctx[order]]


def _decode_mix(g: _Grid) -> None:
    """decode(mix) (module docstring): without drafts only (the verify width is its own axis)."""
    lim = g.lim
    if lim.spec_k:
        return
    batches = [b for b in lim.decode_buckets() if MIX_MIN_ROWS <= b <= lim.max_seqs]
    for b in batches:
        for m in MIX_MEANS:
            for s in MIX_SPREADS:
                ctx = mix_contexts(b, m, s)
                if max(ctx) > lim.decode_cap(0):
                    continue
                axes = [_ax("batch", batches, b), _ax("mean", MIX_MEANS, m)]
                axes.append(_ax("spread", MIX_SPREADS, s))
                g.add_own("decode(mix)", [decode_row(c) for c in ctx], axes)
                if s:
                    g.add_own("decode(mix desc)", [decode_row(c) for c in sorted(ctx)[::-1]], axes)


def _uneven_chunks(g: _Grid) -> None:
    """chunks(uneven): per token total T and decode rows D, four splits of T: 3/4 + 1/4 fresh,
    1/2 + three 1/6 fresh, a later 1/4 (after UNEVEN_PRIOR cached) + a fresh 3/4, a later 3/4 +
    a fresh 1/4. No random draw: the seeded families' points do not move."""
    lim = g.lim
    k = lim.spec_k
    q = 1 + k
    totals = sorted({min(t, lim.max_tokens) for t in UNEVEN_TOTALS})
    for total in totals:
        for d in UNEVEN_ROWS:
            t = min(total, lim.max_tokens - d * q)
            if t < 8 * MIN_PREFILL_TOKENS:
                continue
            rows = [decode_row(min(UNEVEN_ROW_CONTEXT, lim.decode_cap(k)), k)] * d
            a, b, c = t * 3 // 4, t // 4, t // 6
            splits = [
                [Entry(0, a, True), Entry(0, t - a, True)],
                [Entry(0, t - 3 * c, True), *[Entry(0, c, True)] * 3],
            ]
            s = min(UNEVEN_PRIOR, lim.prefill_cap - a)  # a prior the longer later chunk fits
            if s >= PRIOR_MIN:
                splits += [
                    [Entry(s, b, True), Entry(0, t - b, True)],
                    [Entry(s, a, True), Entry(0, t - a, True)],
                ]
            axes = [_ax("tokens", totals, total), _ax("rows", UNEVEN_ROWS, d)]
            for chunks in splits:
                g.add("chunks(uneven)", [*rows, *chunks], axes)


def quick_grid(batches: Sequence[Batch], per_kind: int) -> list[Batch]:
    """About `per_kind` batches of each kind, spread over the grid (tests, smoke runs)."""
    out: list[Batch] = []
    for kind in ("mixed", "decode"):
        mine = [b for b in batches if b.kind == kind]
        if mine:
            step = max(1, len(mine) // per_kind)
            out.extend(mine[::step])
    return out


def axes_of(batches: Sequence[Batch]) -> dict[str, dict[str, list[int]]]:
    """Per family, the values each lattice axis takes (the file's metadata `grid.axes`)."""
    out: dict[str, dict[str, set[int]]] = {}
    for b in batches:
        fam = out.setdefault(b.label, {})
        for name, v in b.axes:
            fam.setdefault(name, set()).add(v)
    return {f: {a: sorted(v) for a, v in ax.items()} for f, ax in out.items()}
