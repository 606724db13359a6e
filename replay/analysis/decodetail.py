"""The decode pass's tail term: time per key of the longest attention program beyond the mean row's.

The decode table is fitted on the shapes sweep, whose batches give every row one context length;
a run's batch mixes them. On the H100 (2026-11-26) the runs' clean queued decode steps sat above
the sweep-fitted table by an amount that grew with the batch (llama3-8b calibration run x0.998
at 2 rows, x1.107 at 142), and the excess follows `tail_keys` (sim.cost.splits: the keys the
longest attention program walks beyond a mean-context row's program), not the rows: at a fixed
batch the ratio climbs with the tail (8b, all runs, 32-127 rows: x1.040 at 256-1023 tail keys,
x1.107 at >= 2048). Fitted on each calibration run alone, 0.756 us a key (llama3-8b, 32
layers) and 0.355 (llama3.2-1b, 16 layers): ~23 ns a key a layer on both. With it the
calibration runs' clean queued steps sit within 2 % of the model in every band of rows and
the checks' (never fitted) within 3 % in all but three of 38 bands (1b asap's). `python
reports/fidelity/decode_tail.py` prints the evidence.

The coefficient is the median of (measured - bulk) / tail_keys over the calibration runs' clean
queued decode steps whose tail holds at least MIN_TAIL_KEYS keys (below that the step's noise
swamps it), `bulk` the decode model's table branch: the term is added there, and the straggler
branch (`program_keys`: the longest program alone) stays the floor it was. The banded level
(replay.analysis.level) then levels what is left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bubblesim.core.runfmt import Run
from sim.cost.linear import MAX_KEY, PROGRAM_KEYS, TAIL_KEYS

from .level import queued_decode_samples

MIN_TAIL_KEYS = 256  # steps with a shorter tail do not enter the fit
MIN_TAIL_STEPS = 100  # fewer such steps: no tail term


def fit_tail(runs: Sequence[Run], decode: Mapping[str, Any]) -> tuple[float | None, dict]:
    """ms per tail key of the runs' clean queued decode steps above the bulk of `decode` (its
    branches that take the term, `bulk`), or None when too few steps have a tail or the median
    excess is not positive."""
    meas, pred, _, tail = queued_decode_samples(runs, bulk(decode))
    sel = tail >= MIN_TAIL_KEYS
    report: dict[str, Any] = {"steps": int(sel.sum())}
    if sel.sum() < MIN_TAIL_STEPS:
        return None, report
    per_key = (meas[sel] - pred[sel]) / tail[sel]
    c = float(np.median(per_key))
    report.update(
        ms_per_key=c,
        p10=float(np.percentile(per_key, 10)),
        p90=float(np.percentile(per_key, 90)),
    )
    return (c if c > 0 else None), report


def bulk(model: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a decode model the tail term adds to: a max form's bulk branch (`with_tail`;
    several: the max of them), else the model."""
    if MAX_KEY not in model:
        return dict(model)
    parts = [model[MAX_KEY][i] for i in _bulk_branches(list(model[MAX_KEY]))]
    return dict(parts[0]) if len(parts) == 1 else {MAX_KEY: parts}


def _bulk_branches(branches: list[Mapping[str, Any]]) -> list[int]:
    """Branches holding a table, else those without the straggler's `program_keys`."""
    tabled = [i for i, b in enumerate(branches) if "table" in b]
    return tabled or [i for i, b in enumerate(branches) if PROGRAM_KEYS not in b]


def with_tail(model: Mapping[str, Any], ms_per_key: float) -> dict[str, Any]:
    """The decode model with `tail_keys` x ms_per_key on its bulk branch (the branches of a max
    form that hold a table, else those without the straggler's `program_keys`), or on the
    model itself."""
    if MAX_KEY not in model:
        return {**model, TAIL_KEYS: ms_per_key}
    branches = list(model[MAX_KEY])
    tabled = _bulk_branches(branches)
    out = [
        ({**b, TAIL_KEYS: ms_per_key} if i in tabled else dict(b)) for i, b in enumerate(branches)
    ]
    return {**model, MAX_KEY: out}
