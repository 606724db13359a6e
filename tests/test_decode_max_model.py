"""`gpu_pass.decode` as the larger of linear branches (`{"max": [...]}`) with the derived term
`program_keys` (sim.cost.splits: keys of the longest decode attention program): evaluation,
validation, the engine's split rule, calibration from a sweep, and fast-forward equality."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import Config, load_config
from bubblesim.core.shape import BatchShape
from replay.analysis.calibrate import calibrate
from sim.cost import CostModel, ProfileError, save_profile, validate_profile
from sim.cost.splits import program_keys_fn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffcheck import assert_same_records, records_without_and_with_fast_forward  # noqa: E402
from test_replay_shapes import DECODE, H100, MIXED, _lin, eager_run  # noqa: E402
from test_sim_max_kv import _mixed_trace  # noqa: E402

BULK = {"intercept": 1.0, "kv_read_tokens": 2e-5}
STRAGGLER = {"intercept": 1.0, "program_keys": 4e-4}
MAX = {"max": [BULK, STRAGGLER]}


def _cm(decode: dict, model: str = "llama3.2-1b", gpu: str = "h200") -> CostModel:
    prof = {"version": 1, "gpu_pass": {"decode": decode}}
    return CostModel(Config(model=model, gpu=gpu), prof)


def test_max_form_is_the_larger_branch() -> None:
    fn = _cm(MAX).gpu_decode_ms_fn()
    keys = program_keys_fn(8, 132)
    # 40 short requests + one of 38k: a large batch splits the long one 8 ways (4750 keys)
    long = BatchShape(num_reqs=41, decode_tokens=41, kv_read_tokens=38000 + 40 * 500,
                      max_kv_tokens=38000)  # fmt: skip
    assert keys(41, 38000) == 4800  # 75 tiles of 64 in 8 runs of 10 tiles
    assert fn(long) == pytest.approx(1.0 + 4e-4 * 4800)
    even = BatchShape(num_reqs=64, decode_tokens=64, kv_read_tokens=64 * 2000, max_kv_tokens=2000)
    assert fn(even) == pytest.approx(1.0 + 2e-5 * 64 * 2000)  # the KV stream wins
    assert _cm(BULK).gpu_decode_ms_fn()(long) == pytest.approx(1.0 + 2e-5 * 58000)
    assert fn(long) == _cm(MAX).gpu_pass_ms(long)  # deterministic, same function


def test_split_rule_matches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """sim.cost.splits mirrors engine.kernels.decode_attention (split count, tile, min_tiles)."""
    dattn = pytest.importorskip("engine.kernels.decode_attention")
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(dattn, "_num_sms", lambda index: 132)
    dev = torch.device("cuda", 0)
    keys = program_keys_fn(8, 132)
    for n in (1, 2, 3, 5, 8, 12, 17, 24, 32, 33, 40, 96, 256):
        for mx in (1, 100, 4096, 4097, 9000, 16384, 38000):
            splits, block_n = dattn.decode_num_splits(n, 8, 131072, dev)
            tiles = -(-mx // block_n)
            large = dattn._fills_gpu(n, 8, dev)
            min_tiles = max(1, dattn.LONG_SPLIT_KEYS // block_n) if large else 1
            per = max(-(-tiles // splits), min_tiles)  # the kernel's tiles_per_split
            assert keys(n, mx) == min(per, tiles) * block_n, (n, mx)


def test_bad_max_forms_get_one_clear_error(tmp_path: Path) -> None:
    validate_profile({"version": 1, "gpu_pass": {"decode": MAX}})
    bad = [
        ({"max": [BULK]}, "gpu_pass.decode.max'"),
        ({"max": BULK}, "gpu_pass.decode.max'"),
        ({"max": [BULK, {"bogus": 1.0}]}, "gpu_pass.decode.max[1].bogus"),
        ({"max": [BULK, {"intercept": "x"}]}, "gpu_pass.decode.max[1].intercept"),
        ({"max": [BULK, STRAGGLER], "intercept": 1.0}, "gpu_pass.decode.intercept"),
    ]
    for decode, key in bad:
        with pytest.raises(ProfileError, match=key.replace("[", r"\[").replace("]", r"\]")):
            validate_profile({"version": 1, "gpu_pass": {"decode": decode}})
    # the derived term belongs to pure-decode GPU models only
    with pytest.raises(ProfileError, match="gpu_pass.mixed.program_keys"):
        validate_profile({"version": 1, "gpu_pass": {"mixed": STRAGGLER}})
    with pytest.raises(ProfileError, match="cpu_phases.sample.program_keys"):
        validate_profile({"version": 1, "cpu_phases": {"sample": {"program_keys": 1.0}}})
    path = save_profile(tmp_path / "p.json", {"version": 1, "gpu_pass": {"decode": MAX}})
    assert CostModel(load_config(None, [f"profile={path}"]), None) is not None


def _sweep_rows(path: Path, c: float, delta: float) -> Path:
    """The real grid's shapes; decode rows follow max(DECODE, DECODE w/o KV + c x program_keys)
    less `delta` (a sweep's missing input copy and sampling), mixed rows MIXED."""
    from replay.gpu.shapes import (
        FORMAT_VERSION,
        Limits,
        Sample,
        batch_shape,
        grid,
        shape_row,
        write_sweep,
    )

    keys = program_keys_fn(2, 132)  # the tiny model's kv heads
    base = {k: v for k, v in DECODE.items() if k != "kv_read_tokens"}
    rows = []
    for b in grid(Limits(512, 64, 40000)):
        s = batch_shape(b.entries)
        if b.kind == "mixed":
            ms = _lin(MIXED, s)
        else:
            strag = _lin(base, s) + c * keys(s["num_reqs"], s["max_kv_tokens"])
            ms = max(_lin(DECODE, s), strag) - delta
        bucket = len(b.entries) if b.kind == "decode" else 0
        rows.append(shape_row(b, [Sample(ms, 0.1, 0.2)], 0, bucket, b.max_seq_len, 1, False))
    meta = {"format": "replay.shapes", "version": FORMAT_VERSION, "model": "tiny", "gpu": H100}
    return write_sweep(path, rows, {**meta, "dtype": "bfloat16"})


def test_calibration_recovers_a_max_model(tmp_path: Path) -> None:
    runs = [eager_run(tmp_path / f"r{i}", seed=i) for i in range(2)]
    sweep = _sweep_rows(tmp_path / "s.parquet", c=2e-3, delta=0.15)
    cal = calibrate(runs, shapes=[sweep])
    dec = cal.profile["gpu_pass"]["decode"]
    assert "max" in dec, cal.notes
    bulk, strag = dec["max"]
    for term, true in DECODE.items():
        assert bulk.get(term, 0.0) == pytest.approx(true, rel=1e-6)
    assert strag["program_keys"] == pytest.approx(2e-3, rel=0.05)
    assert "kv_read_tokens" not in strag
    rep = cal.quality["gpu_pass.decode.straggler"]
    assert rep["sweep_offset_ms"] == pytest.approx(0.15, abs=0.02)
    assert rep["straggler_rows"] >= 3
    assert rep["sweep_max"]["rmse_ms"] < rep["sweep_bulk_only"]["rmse_ms"]
    # a sweep with no straggler keeps the linear model (and says so)
    flat = _sweep_rows(tmp_path / "f.parquet", c=0.0, delta=0.15)
    lin = calibrate(runs, shapes=[flat])
    assert "max" not in lin.profile["gpu_pass"]["decode"]
    assert any("kept it linear" in n for n in lin.notes)
    # without a sweep: the plain linear fit, as before
    assert "max" not in calibrate(runs).profile["gpu_pass"]["decode"]


def test_fast_forward_equals_the_step_loop_with_the_max_form(tmp_path: Path) -> None:
    trace = _mixed_trace(tmp_path, 3)
    lin = {"intercept": 4.0, "num_tokens": 0.004, "kv_read_tokens": 2e-5}
    strag = {"intercept": 4.0, "num_tokens": 0.004, "program_keys": 4e-3}
    outs = {}
    for name, decode in (("max", {"max": [lin, strag]}), ("lin", lin)):
        path = save_profile(
            tmp_path / f"{name}.json", {"version": 1, "gpu_pass": {"decode": decode}}
        )
        sets = ["model=llama3-8b", "gpu=h200", f"profile={path}"]
        outs[name] = records_without_and_with_fast_forward(sets, trace)
        assert_same_records(*outs[name], name)
    assert not np.array_equal(outs["max"][1].gpu_end, outs["lin"][1].gpu_end)
