"""What a trace holds, in numbers (`python -m sim trace info`). Vectorised over the columns."""

from __future__ import annotations

from typing import Any

import numpy as np

from bubblesim.core.config import ConfigError
from bubblesim.core.scenario import SCENARIO_KEY, Scenario, parse_scenario
from bubblesim.core.trace import Trace
from bubblesim.workloads.textids import ngram_accepted

NGRAM_SAMPLE = 32  # requests scored for the prompt-lookup hit rate (it is a Python loop)


def _dist(x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, dtype=np.float64)
    return {
        "mean": float(x.mean()),
        "p50": float(np.percentile(x, 50)),
        "p99": float(np.percentile(x, 99)),
        "max": float(x.max()),
    }


def prefix_reuse(trace: Trace) -> float:
    """Fraction of all prompt tokens that sit inside a shared prefix an earlier-arriving request
    of the same prefix_id already had (the most a prefix cache with no eviction could skip)."""
    total = float(trace.prompt_len.sum())
    if trace.prefix_group is None or trace.prefix_len is None or total == 0:
        return 0.0
    order = trace.arrival_order()
    g = trace.prefix_group[order].astype(np.int64)
    plen = trace.prefix_len[order].astype(np.int64)
    keep = g >= 0
    g, plen = g[keep], plen[keep]
    if len(g) < 2:
        return 0.0
    by_group = np.argsort(g, kind="stable")  # arrival order kept inside each group
    gs, ls = g[by_group], plen[by_group]
    big = int(ls.max()) + 1  # groups ascend, so g*big + len climbs group by group
    running = np.maximum.accumulate(gs * big + ls) - gs * big  # max prefix_len so far in group
    earlier = np.zeros_like(ls)
    same = gs[1:] == gs[:-1]
    earlier[1:] = np.where(same, running[:-1], 0)
    return float(np.minimum(ls, earlier).sum()) / total


def trace_stats(trace: Trace) -> dict[str, Any]:
    n = len(trace)
    arrival = np.sort(trace.arrival_s)
    span = float(arrival[-1] - arrival[0])
    gaps = np.diff(arrival)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) >= 2 and gaps.mean() > 0 else None
    stats: dict[str, Any] = {
        "rows": n,
        "span_s": span,
        "req_per_s": (n - 1) / span if span > 0 else None,
        "interarrival_cv": cv,
        "prompt_len": _dist(trace.prompt_len),
        "output_len": _dist(trace.output_len),
        "prompt_tokens": int(trace.prompt_len.sum()),
        "output_tokens": int(trace.output_len.sum()),
        "needs_history_fraction": float(trace.history_mask().mean()),
        "prefix_reuse": prefix_reuse(trace),
        "prefix_groups": 0 if trace.prefix_keys is None else len(trace.prefix_keys),
        "spec_columns": [
            c for c in ("prompt_ids", "output_ids", "accept_rate") if getattr(trace, c) is not None
        ],
    }
    if trace.accept_rate is not None:
        stats["accept_rate_mean"] = float(trace.accept_rate.mean())
    if trace.prompt_ids is not None and trace.output_ids is not None:
        stats["ngram_k3_draft_fraction"] = ngram_draft_fraction(trace, NGRAM_SAMPLE)
    stats["metadata"] = {k: v for k, v in trace.metadata.items() if k != "text_sources"}
    return stats


def ngram_draft_fraction(trace: Trace, sample: int) -> float:
    """Share of output tokens a k=3 prompt-lookup proposer gets accepted (first `sample` rows)."""
    assert trace.prompt_ids is not None and trace.output_ids is not None
    accepted = produced = 0
    for i in range(min(sample, len(trace))):
        seq = np.concatenate([trace.prompt_ids[i], trace.output_ids[i]])
        accepted += int(ngram_accepted(seq, len(trace.prompt_ids[i])).sum())
        produced += len(trace.output_ids[i])
    return accepted / max(1, produced)


def format_stats(name: str, s: dict[str, Any]) -> str:
    def d(key: str) -> str:
        x = s[key]
        return f"mean {x['mean']:.0f}, p50 {x['p50']:.0f}, p99 {x['p99']:.0f}, max {x['max']:.0f}"

    rate = f"{s['req_per_s']:.3g} req/s" if s["req_per_s"] else "all at one instant"
    cv = f"{s['interarrival_cv']:.2f}" if s["interarrival_cv"] is not None else "n/a"
    lines = [
        f"{name}: {s['rows']:,} requests over {s['span_s']:.1f} s ({rate}, inter-arrival CV {cv})",
        f"  prompt_len  {d('prompt_len')}  ({s['prompt_tokens']:,} tokens)",
        f"  output_len  {d('output_len')}  ({s['output_tokens']:,} tokens)",
        f"  needs_history {s['needs_history_fraction']:.1%}; prefix reuse {s['prefix_reuse']:.1%}"
        f" of prompt tokens ({s['prefix_groups']:,} prefix ids)",
        f"  spec columns: {', '.join(s['spec_columns']) or 'none'}",
    ]
    if "accept_rate_mean" in s:
        lines.append(f"  accept_rate mean {s['accept_rate_mean']:.3f}")
    if "ngram_k3_draft_fraction" in s:
        lines.append(
            f"  prompt lookup (k=3, n=2..4): {s['ngram_k3_draft_fraction']:.1%} of output "
            f"tokens from accepted drafts (first {NGRAM_SAMPLE} requests)"
        )
    for key in ("source", "license", "description"):
        if key in s["metadata"]:
            lines.append(f"  {key}: {s['metadata'][key]}")
    if SCENARIO_KEY in s["metadata"]:
        lines.append(f"  scenario: {_scenario_text(s['metadata'][SCENARIO_KEY])}")
    return "\n".join(lines)


def _scenario_text(text: str) -> str:
    """The scenario's keys on one line (what `sim run` / `sim whatif` apply), or why not."""
    try:
        scenario = Scenario("", parse_scenario(text, "this trace"))
    except ConfigError as e:
        return f"not usable ({e})"
    return f"{scenario.keys_text()} (applied by sim run and sim whatif)"
