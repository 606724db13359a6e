"""A profile records the rule its mixed fits' grid terms were computed with (`mixed_grid`):
"longest" (the longest chunk's query blocks, as the kernel sizes its grid; what calibrate
writes) or "mean" (the mean chunk: every profile fitted before, which keeps predicting as it did
when the key is absent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bubblesim.core.config import Config
from bubblesim.core.shape import BatchShape
from replay.analysis.shapes_grid import Entry, batch_shape
from sim.cost import CostModel, validate_profile
from sim.cost.profile import MIXED_GRID_KEY, ProfileError

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "reports/fidelity/gen/profile-h100-llama3.2-1b.json"
CFG = Config(model="llama3.2-1b", gpu="h100", num_kv_blocks=40000)


def _ms(prof: dict, entries: list[Entry]) -> float:
    fit = {k: v for k, v in prof.items() if k not in ("gpu", "model", "dtype")}
    return CostModel(CFG, fit).gpu_pass_ms(BatchShape(**batch_shape(entries)))


def _profile(rule: str | None) -> dict:
    prof = json.loads(PROFILE.read_text())
    prof.pop(MIXED_GRID_KEY, None)
    if rule is not None:
        prof[MIXED_GRID_KEY] = rule
    return prof


def test_the_rule_changes_only_steps_of_unequal_chunks():
    uneven = [Entry(0, 6144, True), Entry(0, 2048, True)]
    one = [Entry(0, 4096, True)]
    equal = [Entry(0, 2048, True)] * 4
    absent, mean, longest = _profile(None), _profile("mean"), _profile("longest")
    for entries in (uneven, one, equal):
        assert _ms(absent, entries) == _ms(mean, entries)  # absent: the older files' rule
    assert _ms(longest, one) == _ms(mean, one) and _ms(longest, equal) == _ms(mean, equal)
    assert _ms(longest, uneven) != _ms(mean, uneven)


def test_a_bad_rule_is_one_clear_error():
    with pytest.raises(ProfileError, match="mixed_grid"):
        validate_profile(_profile("widest"), "p.json")
