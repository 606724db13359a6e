"""The decode pass's `tail_keys` term (sim.cost.splits.tail_keys_fn; fitted by
replay.analysis.decodetail): its value, its place in a max-form model, its fit from runs whose
steps carry it, and fast-forward equality with it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.runfmt import load_run
from bubblesim.core.shape import BatchShape
from replay.analysis.decodetail import bulk, fit_tail, with_tail
from sim.cost import CostModel, save_profile, validate_profile
from sim.cost.splits import TAIL_CAP_KEYS, program_keys_fn, tail_keys_fn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_without_and_with_fast_forward  # noqa: E402
from helpers import mark_measured  # noqa: E402
from test_sim_max_kv import _mixed_trace  # noqa: E402

LIN = {"intercept": 1.0, "kv_read_tokens": 2e-5}


def test_tail_keys_is_the_longest_program_beyond_the_mean_rows() -> None:
    tail, keys = tail_keys_fn(8, 132), program_keys_fn(8, 132)
    assert tail(16, 16 * 500, 500) == 0  # one context length: no tail
    assert tail(0, 0, 0) == 0 and tail(3, 0, 0) == 0
    # 128 rows (1024 programs, no split below 4096 keys): the longest row's tiles beyond the mean's
    assert tail(128, 128 * 636, 4000) == keys(128, 4000) - keys(128, 636) == 4032 - 640
    # 16 rows split 2 ways: the longest program's keys halve
    assert tail(16, 16 * 2202, 6253) == keys(16, 6253) - keys(16, 2203) == 1024
    assert tail(32, 32 * 1000, 131071) == TAIL_CAP_KEYS  # past the cap: the straggler's


def test_with_tail_goes_on_the_table_branch_and_evaluates() -> None:
    table = {"table": {"x": "num_tokens", "y": "kv_per_token", "xs": [1, 256], "ys": [0, 8192],
                       "ms": [[1.0, 2.0], [3.0, 4.0]]}}  # fmt: skip
    strag = {"intercept": 0.5, "program_keys": 1e-4}
    model = with_tail({"max": [table, strag]}, 1e-3)
    assert model["max"][0]["tail_keys"] == 1e-3 and "tail_keys" not in model["max"][1]
    assert with_tail({"max": [LIN, strag]}, 1e-3)["max"][0]["tail_keys"] == 1e-3
    assert with_tail(LIN, 2e-3) == {**LIN, "tail_keys": 2e-3}
    prof = {"version": 1, "gpu_pass": {"decode": with_tail(LIN, 1e-3)}}
    validate_profile(prof)
    cfg = load_config(None, ["model=llama3-8b", "gpu=h100"])
    cm, base = CostModel(cfg, prof), CostModel(cfg, {"version": 1, "gpu_pass": {"decode": LIN}})
    uniform = BatchShape(num_reqs=16, decode_tokens=16, kv_read_tokens=16 * 500,
                         attn_pairs=16 * 500, max_kv_tokens=500)  # fmt: skip
    mixed = BatchShape(num_reqs=16, decode_tokens=16, kv_read_tokens=16 * 2202,
                       attn_pairs=16 * 2202, max_kv_tokens=6253)  # fmt: skip
    assert cm.gpu_pass_ms(uniform) == base.gpu_pass_ms(uniform)
    assert cm.gpu_pass_ms(mixed) == pytest.approx(base.gpu_pass_ms(mixed) + 1024 * 1e-3)


def _measured(tmp_path: Path, decode: dict) -> list:
    """A simulated run with `decode`, marked as measured (its steps mix context lengths)."""
    trace = _mixed_trace(tmp_path, 3)
    path = save_profile(tmp_path / "p.json", {"version": 1, "gpu_pass": {"decode": decode}})
    cfg = load_config(None, ["model=llama3-8b", "gpu=h100", f"profile={path}"])
    simrun.simulate(cfg, trace, tmp_path / "run")
    mark_measured(tmp_path / "run")
    return [load_run(tmp_path / "run")]


def test_fit_tail_recovers_the_coefficient(tmp_path: Path) -> None:
    runs = _measured(tmp_path, with_tail(LIN, 4e-4))
    c, report = fit_tail(runs, LIN)
    if c is None:  # the trace must hold enough tailed queued steps for the test to mean much
        pytest.fail(f"no tail fitted: {report}")
    assert c == pytest.approx(4e-4, rel=1e-6) and report["steps"] >= 100
    assert fit_tail(runs, with_tail(LIN, 4e-4))[0] is None  # nothing left above the model


def test_fast_forward_equals_the_step_loop_with_the_tail(tmp_path: Path) -> None:
    trace = _mixed_trace(tmp_path, 3)
    outs = {}
    for name, decode in (("tail", with_tail(LIN, 4e-3)), ("lin", LIN)):
        path = save_profile(
            tmp_path / f"{name}.json", {"version": 1, "gpu_pass": {"decode": decode}}
        )
        sets = ["model=llama3-8b", "gpu=h100", f"profile={path}"]
        outs[name] = records_without_and_with_fast_forward(sets, trace)
        assert_same_records(*outs[name], name)
    assert not np.array_equal(outs["tail"][1].gpu_end, outs["lin"][1].gpu_end)


def test_fit_tail_fits_above_the_bulk_branch_not_the_straggler(tmp_path: Path) -> None:
    """Where the straggler branch wins the max, the tail is still measured against the bulk."""
    strag = {"intercept": 1.0, "program_keys": 2e-4}
    runs = _measured(tmp_path, {"max": [with_tail(LIN, 4e-4), strag]})
    c, _ = fit_tail(runs, {"max": [LIN, strag]})
    assert c == pytest.approx(4e-4, rel=1e-6)
    assert bulk({"max": [LIN, strag]}) == LIN
