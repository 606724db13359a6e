"""Synthetic traces: arrivals from a renewal process, lengths from a distribution or a file,
optional history flags, acceptance rates and real token ids.

One seed drives every draw. The root Generator spawns one child per concern (arrivals,
lengths, history flags, text), so changing, say, the length distribution leaves the arrival
times of the same seed unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bubblesim.core.cli import UsageError
from bubblesim.core.trace import Trace, make_trace
from bubblesim.workloads.arrivals import arrival_times
from bubblesim.workloads.lengths import LengthDist, read_length_pairs, sample_pairs
from bubblesim.workloads.textids import text_token_ids


@dataclass(frozen=True)
class SynthSpec:
    arrival: str = "poisson"  # see arrivals.ARRIVALS
    rate: float = 1.0  # requests per second
    cv: float = 1.0  # inter-arrival coefficient of variation (gamma, weibull)
    num_requests: int | None = None
    duration_s: float | None = None
    prompt_len: LengthDist | None = None
    output_len: LengthDist | None = None
    lengths_from: str | None = None  # a trace or length CSV: empirical (prompt, output) pairs
    needs_history: float = 0.0  # fraction of requests whose sampling needs the output history
    accept_rate: float | None = None  # per-draft-token acceptance probability column
    token_ids: bool = False  # real byte-level token ids of stdlib text
    ngram_friendly: bool = False  # pick the most repetitive text windows (with token_ids)
    seed: int = 0


def _check(spec: SynthSpec) -> None:
    if spec.lengths_from is None and (spec.prompt_len is None or spec.output_len is None):
        raise UsageError("give --lengths-from FILE, or both --prompt-len and --output-len")
    if not 0.0 <= spec.needs_history <= 1.0:
        raise UsageError(f"--needs-history {spec.needs_history}: must be a fraction in [0, 1]")
    if spec.accept_rate is not None and not 0.0 <= spec.accept_rate <= 1.0:
        raise UsageError(f"--accept-rate {spec.accept_rate}: must be in [0, 1]")
    if spec.ngram_friendly and not spec.token_ids:
        raise UsageError("--ngram-friendly needs --token-ids")


def synthesize(spec: SynthSpec) -> Trace:
    _check(spec)
    arr_rng, len_rng, hist_rng, text_rng = np.random.default_rng(spec.seed).spawn(4)
    arrival = arrival_times(
        arr_rng, spec.arrival, spec.rate, spec.cv, spec.num_requests, spec.duration_s
    )
    n = len(arrival)
    if spec.lengths_from is not None:
        prompt, output = sample_pairs(len_rng, read_length_pairs(spec.lengths_from), n)
        if spec.prompt_len is not None:  # an explicit distribution overrides the file's
            prompt = spec.prompt_len.sample(len_rng, n)
        if spec.output_len is not None:
            output = spec.output_len.sample(len_rng, n)
    else:
        assert spec.prompt_len is not None and spec.output_len is not None
        prompt = spec.prompt_len.sample(len_rng, n)
        output = spec.output_len.sample(len_rng, n)
    columns: dict = {}
    if spec.needs_history > 0:
        columns["needs_history"] = hist_rng.random(n) < spec.needs_history
    if spec.accept_rate is not None:
        columns["accept_rate"] = np.full(n, spec.accept_rate, dtype=np.float32)
    meta = {"source": "synthetic (python -m sim trace synth)", "license": "generated; no terms"}
    if spec.token_ids:
        p_ids, o_ids, sources = text_token_ids(text_rng, prompt, output, spec.ngram_friendly)
        columns.update(prompt_ids=p_ids, output_ids=o_ids)
        meta["text_sources"] = sources
        meta["license"] = "generated; token ids are bytes of CPython's standard library (PSF-2.0)"
    meta["description"] = describe(spec, n)
    return make_trace(arrival, prompt, output, metadata=meta, **columns)


def describe(spec: SynthSpec, n: int) -> str:
    if spec.arrival in ("poisson", "fixed"):
        arr = f"{spec.arrival} arrivals at {spec.rate:g} req/s"
    elif spec.arrival == "burst":
        arr = "all arriving at t=0"
    else:
        arr = f"{spec.arrival} arrivals at {spec.rate:g} req/s, CV {spec.cv:g}"
    parts = [f"{n} requests, {arr}"]
    if spec.lengths_from:
        parts.append(f"lengths from {spec.lengths_from}")
    if spec.prompt_len is not None:
        parts.append(f"prompt {spec.prompt_len.describe()}")
    if spec.output_len is not None:
        parts.append(f"output {spec.output_len.describe()}")
    if spec.needs_history:
        parts.append(f"needs_history {spec.needs_history:g}")
    if spec.accept_rate is not None:
        parts.append(f"accept_rate {spec.accept_rate:g}")
    if spec.token_ids:
        parts.append("byte token ids of stdlib text" + (" (n-gram friendly)" * spec.ngram_friendly))
    return "; ".join(parts) + f"; seed {spec.seed}"
