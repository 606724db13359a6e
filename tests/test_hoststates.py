"""replay.analysis.hoststates: a two-state host read back from bins of known states, and a
single-state host not split."""

from __future__ import annotations

import math

import numpy as np

from replay.analysis.hoststates import slow_stretches, two_states


def _telegraph(rng: np.random.Generator, n: int, p_in: float, p_out: float) -> np.ndarray:
    """A two-state Markov chain of n bins: p_in a bin to enter the slow state, p_out to leave."""
    slow = np.zeros(n, bool)
    for i in range(1, n):
        slow[i] = (rng.random() >= p_out) if slow[i - 1] else (rng.random() < p_in)
    return slow


def test_two_states_recovers_the_states_their_ratio_and_share() -> None:
    rng = np.random.default_rng(1)
    slow = _telegraph(rng, 4000, 0.05, 0.1)  # share 1/3, slow stretches of ~10 bins
    x = np.where(slow, math.log(1.4), math.log(0.8)) + rng.normal(0, 0.08, slow.size)
    mix = two_states(x)
    assert abs(math.exp(mix.mean[0]) - 0.8) < 0.02 and abs(math.exp(mix.mean[1]) - 1.4) < 0.03
    assert abs(mix.weight_slow - slow.mean()) < 0.03
    assert mix.d_bic > 100
    got = mix.slow_posterior(x) > 0.5
    assert (got == slow).mean() > 0.97
    assert abs(np.mean(slow_stretches(got)) - np.mean(slow_stretches(slow))) < 1.5


def test_one_state_gives_no_evidence_for_two() -> None:
    x = np.random.default_rng(2).normal(0.1, 0.1, 4000)
    assert two_states(x).d_bic < 10
    steady = two_states(np.full(300, 0.3))  # a host without noise: one state, a finite BIC
    assert np.isfinite(steady.d_bic) and steady.d_bic < 10


def test_slow_stretches() -> None:
    v = np.array([1, 1, 0, 1, 0, 0, 1, 1, 1], bool)
    assert slow_stretches(v) == [2, 1, 3]
    assert slow_stretches(np.zeros(3, bool)) == []
