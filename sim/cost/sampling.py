"""Random sampling's cost over greedy sampling (profile key `sampling`).

The engine samples greedily at temperature 0 (an argmax: engine.kernels.sampling on CUDA) and
at random above it (engine.sampler.Sampler._sample_random: a Gumbel-max over the vocabulary,
after torch.topk with `top_k`, after a full sort, softmax and cumsum of every row with `top_p`).
Every shape sweep and calibration run samples greedily (the default config), so a profile's GPU
tables and CPU phases hold greedy sampling. A config that samples at random adds, per step, the
measured difference of its mode at the step's sampled rows (`python -m replay sampling`, fitted
by `replay calibrate --sampling-sweep`):

    "sampling": {"vocab": 128256,                    # the vocabulary it was measured at
                 "rows": [1, 2, 4, ..., 1024],       # sampled rows of one step
                 "<mode>": {"gpu_ms": [...],          # plain decoding: Sampler.sample(_graph)
                            "host_ms": [...],         # its eager call (the sample phase)
                            "spec_gpu_ms": [...],     # speculative decoding: Sampler.choose
                            "spec_host_ms": [...]}}   # its eager call (the sample phase)

Each list holds ms over greedy at `rows`, linear between the points and along the last two
points' slope past the last one (below the first: the first value), x the model's vocabulary /
`vocab` (the work is per row and vocabulary entry). `mode_of` names the mode of a sampling
config (MODES); a profile without a table for it takes the defaults' (sim.cost.defaults).

Where the engine pays it (sim.cost.model.CostModel):
- GPU: every step that samples: a decode graph samples its bucket's rows, a mixed graph its
  captured rows, an eager step its generating rows (decodes and prefill requests: the shape
  does not say which chunk ends its prompt), a verify step (Sampler.choose) k + 1 rows a request;
- host, in the sample phase: a step whose sampling is not inside a graph (an eager step; every
  speculative step, whose verification samples after the graph), x host_scale.
Greedy sampling adds nothing, to the bit.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any

SAMPLING_KEY = "sampling"
GREEDY = "greedy"
# the random modes, each with the SamplingConfig a sweep times it at (top_k's cost hardly
# depends on k at this size; top_p's never on p: it sorts every row whole)
MODES: dict[str, dict[str, float]] = {
    "random": {"temperature": 1.0},
    "top_k": {"temperature": 1.0, "top_k": 50},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "top_k_top_p": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
}
TABLES = ("gpu_ms", "host_ms", "spec_gpu_ms", "spec_host_ms")


class SamplingTableError(ValueError):
    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


def mode_of(temperature: float, top_k: int, top_p: float, vocab: int) -> str:
    """The sampling mode of a config: GREEDY or one of MODES (a top_k of the whole vocabulary
    or more is off, as engine.sampler takes it)."""
    if temperature == 0:
        return GREEDY
    k = 0 < top_k < vocab
    p = top_p < 1.0
    if k and p:
        return "top_k_top_p"
    if k:
        return "top_k"
    return "top_p" if p else "random"


def _numbers(key: str, value: Any) -> list[float]:
    if not isinstance(value, list) or not value:
        raise SamplingTableError(key, f"expected a non-empty list of numbers, got {value!r}")
    out = []
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise SamplingTableError(f"{key}[{i}]", f"expected a finite number, got {x!r}")
        out.append(float(x))
    return out


def check_sampling(value: Any) -> None:
    """A `sampling` table; SamplingTableError names the sub-key (`rows`, `top_p.gpu_ms[3]`)."""
    if not isinstance(value, dict):
        raise SamplingTableError("", f"expected an object, got {value!r}")
    for k in value:
        if k not in ("vocab", "rows") and k not in MODES:
            raise SamplingTableError(
                str(k), f"unknown key, expected 'vocab', 'rows' or one of {list(MODES)}"
            )
    for k in ("vocab", "rows"):
        if k not in value:
            raise SamplingTableError(k, "missing")
    vocab = value["vocab"]
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise SamplingTableError("vocab", f"expected a vocabulary size >= 1, got {vocab!r}")
    rows = _numbers("rows", value["rows"])
    for i in range(1, len(rows)):
        if not rows[i] > rows[i - 1]:
            raise SamplingTableError(f"rows[{i}]", f"must be above rows[{i - 1}], got {rows[i]!r}")
    if rows[0] < 1:
        raise SamplingTableError("rows[0]", f"must be >= 1, got {rows[0]!r}")
    for mode in MODES:  # every mode: a profile's table replaces the defaults' whole
        tables = value.get(mode)
        if tables is None:
            raise SamplingTableError(mode, "missing")
        if not isinstance(tables, dict):
            raise SamplingTableError(mode, f"expected an object, got {tables!r}")
        for k in tables:
            if k not in TABLES:
                raise SamplingTableError(f"{mode}.{k}", f"unknown key, expected one of {TABLES}")
        for k in TABLES:
            if k not in tables:
                raise SamplingTableError(f"{mode}.{k}", "missing")
            got = _numbers(f"{mode}.{k}", tables[k])
            if len(got) != len(rows):
                raise SamplingTableError(
                    f"{mode}.{k}",
                    f"expected {len(rows)} numbers (one per row count), got {len(got)}",
                )


class RowTable:
    """ms at a number of sampled rows: linear between the points, along the last two points'
    slope past the last one, the first value below the first."""

    __slots__ = ("rows", "ms", "slope")

    def __init__(self, rows: Sequence[float], ms: Sequence[float]) -> None:
        self.rows = [float(r) for r in rows]
        self.ms = [float(m) for m in ms]
        n = len(self.rows)
        self.slope = 0.0 if n < 2 else (self.ms[-1] - self.ms[-2]) / (self.rows[-1] - self.rows[-2])

    def __call__(self, rows: float) -> float:
        r, ms = self.rows, self.ms
        if rows <= r[0]:
            return ms[0]
        if rows >= r[-1]:
            return ms[-1] + self.slope * (rows - r[-1])
        j = bisect.bisect_right(r, rows) - 1
        return ms[j] + (rows - r[j]) * (ms[j + 1] - ms[j]) / (r[j + 1] - r[j])


def mode_tables(table: Mapping[str, Any], mode: str, vocab: int) -> dict[str, RowTable] | None:
    """The four RowTables of `mode` (None: greedy), each x vocab / the table's vocabulary (the
    work is per row and vocabulary entry)."""
    if mode == GREEDY:
        return None
    scale = vocab / table["vocab"]
    rows = table["rows"]
    return {k: RowTable(rows, [m * scale for m in table[mode][k]]) for k in TABLES}


def eager_host_ms(tables: Mapping[str, RowTable], num_reqs: int, spec_k: int | None) -> float:
    """What a step's sample phase adds when its sampling runs outside a graph (`mode_tables`'
    tables): plain decoding's call at the step's generating rows (every request: the shape does
    not say which prompt chunk ends its prompt), or with speculative decoding (`spec_k`: the
    drafts a request) verification's call at k + 1 rows a request. Not x host_scale."""
    if spec_k is None:
        return tables["host_ms"](num_reqs)
    return tables["spec_host_ms"](num_reqs * (1 + spec_k))
