"""reports/tp/seed_sweep.py: the errors it reads from a comparison and the count of checks within
each target on the mean over seeds."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reports" / "tp"))
from seed_sweep import KEYS, error, within_counts  # noqa: E402


def test_error_is_percent_but_the_bubble_in_points() -> None:
    metrics = {"ttft_s.p50": {"rel_error": -0.125}, "bubble_fraction": {"abs_error_points": 1.5}}
    assert error(metrics, "ttft_s.p50") == -12.5
    assert error(metrics, "bubble_fraction") == 1.5


def test_within_counts_judge_each_mean_against_its_target() -> None:
    # per KEYS: tok/s 3 %, TPOT p50 5 %, TPOT p99 10 %, TTFT p50 10 %, e2e p50 5 %, bubble 2 pt
    assert KEYS[-1] == "bubble_fraction"
    means = {
        "a": [2.9, -5.0, 9.9, -10.0, 4.0, 2.0],  # every one on or under its target
        "b": [3.1, 5.1, -10.1, 10.1, -5.1, -2.1],  # every one just over
    }
    got = within_counts(means)
    assert got == (
        "output_tok_per_s 1/2, tpot_s.p50 1/2, tpot_s.p99 1/2, ttft_s.p50 1/2, e2e_s.p50 1/2, "
        "bubble_fraction 1/2"
    )
