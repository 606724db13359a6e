"""What a sweep times: the grid cut to a budget, and the envelope its rows span (replay.gpu.shapes).

`CostGuess` estimates a shape's GPU time (printed before the sweep, and what `budget_s` is
spent in); `select` keeps the grid's leading shapes that fit a budget and a point count (the grid
is in level order, so what is left out is refinement); `plan` does both for a config and a cache;
`envelope` is the file's metadata of the same name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bubblesim.core.config import Config
from bubblesim.core.gpus import get_gpu
from bubblesim.core.models import get_model
from bubblesim.core.shape import attn_pairs
from replay.analysis.shapes_file import KINDS
from replay.analysis.shapes_grid import MIX_FAMILIES, Batch, Limits, grid, quick_grid

DEFAULT_BUDGET_S = 240.0  # estimated GPU seconds (CostGuess)


@dataclass(frozen=True)
class CostGuess:
    """A rough GPU-time estimate of a grid (to print up front and to fit a budget): a roofline
    at 70 % of the datasheet bandwidth / 50 % of the FLOP rate, plus the spin that hides each
    launch (1.5 x the issue time + 0.5 ms) and an untimed launch per shape."""

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    attn_flops_per_pair: float
    bytes_per_ms: float
    flops_per_ms: float
    eager_issue_ms: float
    graph_issue_ms: float
    per_row_issue_ms: float = 0.004  # host input work per request (inputs.fill)

    @staticmethod
    def of(cfg: Config) -> CostGuess:
        m, gpu = get_model(cfg.model), get_gpu(cfg.gpu)
        dtype = cfg.dtype
        return CostGuess(
            weight_bytes=m.decode_weight_bytes(dtype),
            kv_bytes_per_token=m.kv_bytes_per_token(dtype),
            flops_per_token=m.flops_per_token(),
            attn_flops_per_pair=4 * m.num_layers * m.q_size,
            bytes_per_ms=0.7 * gpu.hbm_gb_per_s * 1e6,
            flops_per_ms=0.5 * gpu.bf16_tflops * 1e9,
            eager_issue_ms=1.0 + 0.4 * m.num_layers,  # ~9 launches a layer at ~45 us
            graph_issue_ms=0.3,
        )

    def step_ms(self, b: Batch, bucket: int = 0) -> float:
        tokens = max(b.num_tokens, bucket * (b.max_query_len if bucket else 1))
        kv = sum(e.seq_len for e in b.entries) * self.kv_bytes_per_token
        pairs = sum(attn_pairs(e.start, e.n) for e in b.entries)
        mem = (self.weight_bytes + kv) / self.bytes_per_ms
        comp = (
            tokens * self.flops_per_token + pairs * self.attn_flops_per_pair
        ) / self.flops_per_ms
        return max(mem, comp) + 0.05

    def shape_s(self, b: Batch, graphed: bool, repeats: int) -> float:
        issue = self.graph_issue_ms if graphed else self.eager_issue_ms
        issue += self.per_row_issue_ms * len(b.entries)
        spin = 1.5 * issue + 0.5
        return (repeats * (spin + self.step_ms(b)) + self.step_ms(b)) / 1e3


def select(
    batches: Sequence[Batch],
    cost_s: Sequence[float],
    budget_s: float | None = None,
    points: int | None = None,
) -> list[int]:
    """Indices of the grid's leading batches that fit `points` and the GPU-time `budget_s`
    (the grid is in level order, so what is left out is refinement). A batch that alone
    exceeds what is left is skipped, not a stop: later, cheaper ones may still fit."""
    keep, spent = [], 0.0
    for i, c in enumerate(cost_s):
        if points is not None and len(keep) >= points:
            break
        if budget_s is not None and spent + c > budget_s:
            continue
        keep.append(i)
        spent += c
    return keep


def envelope(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind, [min, max] of each axis the rows span (the file's metadata `envelope`)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in ("decode", "mixed"):
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        axes = {
            "num_reqs": [r["num_reqs"] for r in mine],
            "num_tokens": [r["prefill_tokens"] + r["decode_tokens"] for r in mine],
            "prefill_tokens": [r["prefill_tokens"] for r in mine],
            "decode_tokens": [r["decode_tokens"] for r in mine],
            "draft_tokens": [r["draft_tokens"] for r in mine],
            "kv_read_tokens": [r["kv_read_tokens"] for r in mine],
            "max_kv_tokens": [r["max_kv_tokens"] for r in mine],
            "kv_per_req": [r["kv_read_tokens"] // max(1, r["num_reqs"]) for r in mine],
        }
        out[kind] = {a: [int(min(v)), int(max(v))] for a, v in axes.items()}
    return out


@dataclass
class Plan:
    """The shapes a sweep times and what they are estimated to cost."""

    batches: list[Batch]
    grid_shapes: int  # in the full grid
    estimate_s: float  # estimated GPU seconds of the selected shapes
    limits: Limits
    families: tuple[str, ...] = ()  # the grid families swept (none: all)


def plan(
    cfg: Config,
    num_kv_blocks: int,
    kinds: Sequence[str] = KINDS,
    quick: int = 0,
    repeats: int = 5,
    budget_s: float | None = DEFAULT_BUDGET_S,
    points: int | None = None,
    max_context: int = 0,
    buckets: Sequence[int] = (),
    families: Sequence[str] = (),
) -> Plan:
    """The grid for `cfg` and a cache of `num_kv_blocks`, cut to `points` / `budget_s`;
    `buckets`: the engine's decode graphs (none: decode runs eagerly); `families`: only these
    grid families (their `label`; none: all)."""
    graphs = bool(buckets)
    lim = Limits.of(cfg, num_kv_blocks, max_context, buckets)
    full = grid(lim, kinds, cfg.seed, mix=any(f in MIX_FAMILIES for f in families))
    if families:
        full = [b for b in full if b.label in families]
    guess = CostGuess.of(cfg)
    if quick:
        full = quick_grid(full, quick)
    cost = [guess.shape_s(b, graphs and b.kind == "decode", repeats) for b in full]
    keep = select(full, cost, None if quick else budget_s, points)
    chosen = [full[i] for i in keep]
    return Plan(chosen, len(full), float(sum(cost[i] for i in keep)), lim, tuple(families))
