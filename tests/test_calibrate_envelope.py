"""`replay calibrate --shapes` with piecewise GPU models (replay/analysis/piecewise.py,
replay/analysis/gpufit.py): synthetic sweeps over the real grid (`replay.analysis.shapes_grid.grid`)
whose times are a known, non-linear function of the shape (+ noise), written with the sweep's own
columns. The fit must give the function back on the sweep, on held-back points and where a
calibration run never went (the long-output batches of issue 12), record its envelope, and level an
older sweep (forward + logits only) by the runs' offset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import Config
from bubblesim.core.models import get_model
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape
from replay.analysis.calibrate import CalibrationError, calibrate, write_calibration
from replay.analysis.shapes_grid import MIN_DECODE_CONTEXT
from replay.analysis.sweepmeta import MEASURES_KEY, MEASURES_STEP
from replay.gpu.shapes import (
    FORMAT_VERSION,
    Limits,
    Sample,
    batch_shape,
    grid,
    shape_row,
    write_sweep,
)
from sim.cost import CostModel
from sim.cost.splits import program_keys_fn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_replay_shapes import DECODE, H100, MIXED, _lin, eager_run  # noqa: E402

LIMITS = Limits(8192, 256, 131072)
KEYS = program_keys_fn(get_model("tiny").num_kv_heads, 132)  # the runs: tiny on an H100


def decode_truth(s: dict[str, int]) -> float:
    """Weights + rows (a knee past 64 rows: compute-bound GEMMs) + the KV stream, whose cost per
    token falls with batch size (few attention programs leave the GPU idle at small batches);
    or the longest attention program, when it is the larger."""
    b, kv = s["decode_tokens"], s["kv_read_tokens"]
    rows = 0.9 + 0.004 * b + 0.01 * max(0, b - 64)
    bulk = rows + 2e-5 * kv * (1 + 2 / (1 + b / 8))
    return max(bulk, rows + 4e-4 * KEYS(s["num_reqs"], s["max_kv_tokens"]))


def mixed_truth(s: dict[str, int]) -> float:
    """GEMMs flat (memory-bound) up to ~200 tokens, then linear; linear attention terms."""
    tok = s["prefill_tokens"] + s["decode_tokens"]
    gemm = 1.0 + 0.0006 * min(tok, 200) + 0.004 * max(0, tok - 200)
    return (
        gemm + 2e-8 * s["attn_pairs"] + 1e-5 * s["kv_read_tokens"] + 0.01 * s["num_reqs"]
        + 0.05 * s["num_prefill_reqs"]
    )  # fmt: skip


def sweep_file(path: Path, truth, noise: float = 0.003, measures: bool = True) -> Path:
    rng = np.random.default_rng(7)
    rows = []
    for b in grid(LIMITS):
        shape = batch_shape(b.entries)
        ms = truth(b.kind, shape) * (1 + noise * rng.standard_normal())
        bucket = len(b.entries) if b.kind == "decode" else 0
        rows.append(shape_row(b, [Sample(ms, 0.1, 0.2)], 0, bucket, b.max_seq_len, 1, False))
    meta = {"format": "replay.shapes", "version": FORMAT_VERSION, "model": "tiny", "gpu": H100,
            "dtype": "bfloat16"}  # fmt: skip
    if measures:
        meta[MEASURES_KEY] = MEASURES_STEP
    return write_sweep(path, rows, meta)


def _truth(kind: str, s: dict[str, int]) -> float:
    return decode_truth(s) if kind == "decode" else mixed_truth(s)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pw")
    runs = [eager_run(tmp / f"r{i}", seed=i) for i in range(2)]
    f = sweep_file(tmp / "s.parquet", _truth)
    return tmp, runs, f, calibrate(runs, shapes=[f])


def test_piecewise_fit_recovers_the_sweep_and_reports_held_back_points(fitted) -> None:
    tmp, _, f, cal = fitted
    gp = cal.profile["gpu_pass"]
    assert "max" in gp["decode"] and "table" in gp["decode"]["max"][0], cal.notes
    assert gp["decode"]["max"][1]["program_keys"] == pytest.approx(4e-4, rel=0.1)
    assert "spline" in gp["mixed"] and gp["mixed"]["attn_pairs"] == pytest.approx(2e-8, rel=0.1)
    cm = CostModel(Config(model="tiny", gpu="h100"), cal.profile)
    rel = []
    for b in grid(LIMITS):
        s = batch_shape(b.entries)
        shape = BatchShape(**{k: s[k] for k in SHAPE_FIELDS})
        rel.append(cm.gpu_pass_ms(shape) / _truth(b.kind, s) - 1)
    assert np.max(np.abs(rel)) < 0.03 and np.median(np.abs(rel)) < 0.005
    held = cal.quality["gpu_pass.held_back"]
    regions = held["regions"]
    assert regions["decode all"]["n"] >= 8 and regions["mixed all"]["n"] >= 20
    assert {"decode b1-7", "decode b8-31", "decode b32-127", "decode b128+"} <= set(regions)
    for name, r in regions.items():
        assert r["max_rel"] < 0.05 and r["median_rel"] <= r["max_rel"], name
    assert cal.verdict.startswith("held-back sweep points: decode median")
    assert cal.verdict.endswith("within 5 % everywhere") and cal.verdict == held["verdict"]
    side = write_calibration(cal, tmp / "p.json", {})
    rep = json.loads(side.read_text())
    assert rep["verdict"] == cal.verdict and rep["fit"]["gpu_pass.held_back"]["every"] == 3
    env = cal.profile["envelope"]
    assert env["decode"]["num_reqs"] == [1, 256]
    assert env["decode"]["kv_per_req"][0] == MIN_DECODE_CONTEXT  # the grid's shortest context
    assert env["mixed"]["prefill_tokens"] == [16, 8192] and "prefill_tokens" not in env["decode"]


def test_the_table_holds_where_the_calibration_run_never_went(fitted) -> None:
    """Issue 12: a linear fit of batches < 32 with <= 16k KV tokens a step (what a calibration
    run held) over-predicts long-output batches of 20-60 requests and 40-70k KV tokens; the
    table fitted on the sweep's grid predicts them, through the sim's compiled function."""
    _, _, _, cal = fitted
    cm = CostModel(Config(model="tiny", gpu="h100"), cal.profile)
    rng = np.random.default_rng(3)
    pts = []
    for _ in range(40):
        b = int(rng.integers(20, 61))
        ctx = [int(c) for c in rng.integers(500, 2000, b)]
        pts.append(batch_shape([grid_entry(c) for c in ctx]))
    truth = np.array([decode_truth(s) for s in pts])
    table = np.array([cm.gpu_pass_ms(BatchShape(**{k: s[k] for k in SHAPE_FIELDS})) for s in pts])
    assert np.max(np.abs(table / truth - 1)) < 0.03
    small = [batch_shape(b.entries) for b in grid(LIMITS) if b.kind == "decode"]
    small = [s for s in small if s["num_reqs"] < 32 and s["kv_read_tokens"] <= 16384]
    x = np.array([[1.0, s["decode_tokens"], s["kv_read_tokens"]] for s in small])
    coef = np.linalg.lstsq(x, [decode_truth(s) for s in small], rcond=None)[0]
    linear = np.array([[1.0, s["decode_tokens"], s["kv_read_tokens"]] for s in pts]) @ coef
    assert np.median(linear / truth - 1) > 0.08  # the failure the table removes


def grid_entry(ctx: int):
    from replay.gpu.shapes import Entry

    return Entry(ctx - 1, 1, False)


def test_an_older_sweep_is_levelled_by_the_runs_offset(tmp_path: Path) -> None:
    """A sweep without `measures: step` times forward + logits only: 0.15 ms less than a run's
    decode step (runs: DECODE exactly). Piecewise on request; auto keeps the linear form."""
    runs = [eager_run(tmp_path / f"r{i}", seed=i) for i in range(2)]

    def old(kind: str, s: dict[str, int]) -> float:
        return _lin(DECODE, s) - 0.15 if kind == "decode" else _lin(MIXED, s)

    f = sweep_file(tmp_path / "old.parquet", old, noise=0.0, measures=False)
    cal = calibrate(runs, shapes=[f], gpu_model="piecewise")
    rep = cal.quality["gpu_pass.decode.piecewise"]
    assert rep["offset_ms"] == pytest.approx(0.15, abs=0.01) and rep["straggler_rows"] == 0
    assert "table" in cal.profile["gpu_pass"]["decode"]
    assert cal.quality["gpu_pass.decode"]["mean_abs_rel_error"] < 0.01  # on the runs' steps
    assert any("shifted by the runs' offset +0.15" in n for n in cal.notes)
    auto = calibrate(runs, shapes=[f])
    assert "table" not in json.dumps(auto.profile["gpu_pass"]) and not auto.verdict


def test_piecewise_needs_a_sweep_and_a_known_mode(tmp_path: Path) -> None:
    runs = [eager_run(tmp_path / "r", seed=0)]
    with pytest.raises(CalibrationError, match="needs a shape sweep"):
        calibrate(runs, gpu_model="piecewise")
    with pytest.raises(CalibrationError, match="--gpu-model 'cubic'"):
        calibrate(runs, gpu_model="cubic")
    lin = calibrate(runs)  # runs only: linear, with the envelope of the clean steps
    env = lin.profile["envelope"]["decode"]
    assert (
        env["num_reqs"][0] >= 1
        and env["num_reqs"][1] <= 24
        and "mixed" not in lin.profile["envelope"]
    )


def test_calibrate_cli_prints_the_verdict(fitted, capsys) -> None:
    from replay.__main__ import main

    tmp, runs, f, _ = fitted
    prof = tmp / "cli.json"
    assert main(["calibrate", *map(str, runs), "--shapes", str(f), "-o", str(prof)]) == 0
    out = capsys.readouterr().out
    assert "held-back sweep points: decode median" in out and "within 5 % everywhere" in out
    assert main(["calibrate", *map(str, runs), "--shapes", str(f), "--gpu-model", "linear",
                 "-o", str(tmp / "lin.json")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "held-back" not in out
    assert "table" not in (tmp / "lin.json").read_text()


def verify_truth(s: dict[str, int]) -> float:
    """A spec verify step (k + 1 query rows per request): GEMMs over its rows, and an attention
    kernel whose cost per KV token follows the requests (programs), not the rows."""
    b, kv = s["num_reqs"], s["kv_read_tokens"]
    rows = 0.9 + 0.004 * s["decode_tokens"] + 0.01 * max(0, s["decode_tokens"] - 64)
    return rows + 2.4e-5 * kv * (1 + 2 / (1 + b / 8)) + 3e-10 * s["attn_pairs"]


def test_spec_verify_rows_get_their_own_table(tmp_path: Path) -> None:
    """Verify widths run paged_attention, not the decode kernel: on the (rows, KV per row)
    grid they disagree with plain decodes, so they are fitted apart (`gpu_pass.verify`)."""
    from replay.gpu.shapes import Batch, Entry

    rng = np.random.default_rng(5)
    rows = []
    batches = list(grid(LIMITS))
    for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128):  # the sweep's decode batches
        for c in (128, 512, 1024, 2048, 4096, 8192, 16384):
            if b * c <= 1 << 18:
                batches.append(Batch("verify", tuple([Entry(c - 1, 4, False)] * b)))
    for b in batches:
        shape = batch_shape(b.entries)
        if b.label == "verify":
            shape["draft_tokens"] = 3 * len(b.entries)
            ms = verify_truth(shape)
        else:
            ms = _truth(b.kind, shape)
        sample = Sample(ms * (1 + 0.003 * rng.standard_normal()), 0.1, 0.2)
        bucket = len(b.entries) if b.kind == "decode" else 0
        row = shape_row(b, [sample], 0, bucket, b.max_seq_len, 1, False)
        rows.append({**row, **shape})
    meta = {"format": "replay.shapes", "version": FORMAT_VERSION, "model": "tiny", "gpu": H100,
            "dtype": "bfloat16", MEASURES_KEY: MEASURES_STEP}  # fmt: skip
    f = write_sweep(tmp_path / "v.parquet", rows, meta)
    cal = calibrate([eager_run(tmp_path / "r", seed=0)], shapes=[f])
    gp = cal.profile["gpu_pass"]
    assert "table" in gp["verify"] and "max" in gp["decode"], cal.notes
    assert cal.profile["envelope"]["verify"]["num_tokens"] == [4, 512]
    regions = cal.quality["gpu_pass.held_back"]["regions"]
    assert regions["verify all"]["max_rel"] < 0.05 and regions["decode all"]["max_rel"] < 0.05
    cm = CostModel(Config(model="tiny", gpu="h100"), cal.profile)
    for r in rows:
        truth = verify_truth(r) if r["label"] == "verify" else decode_truth(r)
        if r["kind"] == "decode":
            got = cm.gpu_pass_ms(BatchShape(**{k: r[k] for k in SHAPE_FIELDS}))
            assert abs(got / truth - 1) < 0.03, r
    # one table for both would miss: the verify rows through the decode table
    plain = CostModel(Config(model="tiny", gpu="h100"), {"version": 1, "gpu_pass": {
        "decode": gp["decode"]}})  # fmt: skip
    miss = [plain.gpu_pass_ms(BatchShape(**{k: r[k] for k in SHAPE_FIELDS})) / verify_truth(r) - 1
            for r in rows if r["label"] == "verify"]  # fmt: skip
    assert np.max(np.abs(miss)) > 0.1
