"""The decode table on a sweep whose graphs pad to their buckets (replay/analysis/graphsteps.py): a
batch between two buckets pays the larger bucket's GEMMs, logits and sampling but only its own rows'
attention. The sweep samples buckets and midpoints (replay.analysis.shapes_grid); the fit must
predict every batch size in between, through the sim's CostModel, and say where it stepped."""

from __future__ import annotations

import bisect
import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import Config
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape
from replay.analysis.calibrate import calibrate
from replay.analysis.graphsteps import padded_segments, with_steps
from replay.analysis.shapes_grid import Entry
from replay.analysis.sweepmeta import MEASURES_KEY, MEASURES_STEP
from replay.gpu.shapes import FORMAT_VERSION, Sample, batch_shape, grid, shape_row, write_sweep
from sim.cost import CostModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_calibrate_envelope import KEYS, LIMITS, mixed_truth  # noqa: E402
from test_replay_shapes import H100, eager_run  # noqa: E402

BUCKETS = LIMITS.decode_buckets()  # 1, 2, 4, 8, 16, 24, ..., 64, 80, ..., 128, 160, ..., 256


def bucket_of(b: int) -> int:
    return BUCKETS[bisect.bisect_left(BUCKETS, b)]


def padded_truth(s: dict[str, int], bucket: int) -> float:
    """GEMMs, logits and sampling over the graph's `bucket` rows (a knee past 64: compute-bound),
    attention over the real rows only (the KV stream, or the longest program)."""
    b, kv = s["num_reqs"], s["kv_read_tokens"]
    rows = 0.9 + 0.004 * bucket + 0.01 * max(0, bucket - 64)
    bulk = rows + 2e-5 * kv * (1 + 2 / (1 + b / 8))
    return max(bulk, rows + 4e-4 * KEYS(s["num_reqs"], s["max_kv_tokens"]))


def padded_sweep(path: Path, pad: bool) -> Path:
    """The grid timed with `padded_truth`; `pad` False writes each decode row's bucket as its
    own batch size (a sweep that does not say its graphs padded)."""
    rng = np.random.default_rng(11)
    rows = []
    for b in grid(LIMITS):
        shape = batch_shape(b.entries)
        if b.kind == "decode":
            bucket = bucket_of(len(b.entries))
            ms = padded_truth(shape, bucket)
            bucket = bucket if pad else len(b.entries)
        else:
            ms, bucket = mixed_truth(shape), 0
        sample = Sample(ms * (1 + 0.003 * rng.standard_normal()), 0.1, 0.2)
        rows.append(shape_row(b, [sample], 0, bucket, b.max_seq_len, 1, False))
    meta = {"format": "replay.shapes", "version": FORMAT_VERSION, "model": "tiny", "gpu": H100,
            "dtype": "bfloat16", MEASURES_KEY: MEASURES_STEP,
            "graph_buckets": BUCKETS if pad else []}  # fmt: skip
    return write_sweep(path, rows, meta)


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("buckets")
    runs = [eager_run(tmp / "r", seed=0)]
    aware = calibrate(runs, shapes=[padded_sweep(tmp / "pad.parquet", pad=True)])
    blind = calibrate(runs, shapes=[padded_sweep(tmp / "nopad.parquet", pad=False)])
    return aware, blind


def _errors(cal) -> np.ndarray:
    """Relative error at every batch size 1..256 (not only the sweep's), uniform contexts."""
    cm = CostModel(Config(model="tiny", gpu="h100"), cal.profile)
    out = []
    for b in range(1, 257):
        for ctx in (100, 700, 3000, 20000):
            s = batch_shape([Entry(ctx - 1, 1, False)] * b)
            got = cm.gpu_pass_ms(BatchShape(**{k: s[k] for k in SHAPE_FIELDS}))
            out.append(got / padded_truth(s, bucket_of(b)) - 1)
    return np.abs(out)


def test_every_batch_size_between_buckets_is_predicted(fits) -> None:
    aware, blind = fits
    rep = aware.quality["gpu_pass.decode.piecewise"]
    assert rep["graph_steps"] >= 15, rep  # a step at every bucket past 2 (3 is a midpoint)
    assert any("stepping at" in n for n in aware.notes), aware.notes
    err = _errors(aware)
    assert err.max() < 0.03 and np.median(err) < 0.005, (err.max(), np.median(err))
    assert aware.verdict.endswith("within 5 % everywhere"), aware.verdict
    held = aware.quality["gpu_pass.held_back"]["regions"]
    assert held["decode all"]["n"] >= 40 and held["decode b8-31"]["n"] >= 8, held
    # the same sweep without its buckets: batches just past a bucket interpolate toward the
    # bucket below (e.g. 65 rows charged 7/8 of the 64 -> 80 step too little)
    assert blind.quality["gpu_pass.decode.piecewise"]["graph_steps"] == 0
    assert _errors(blind).max() > 0.08


def test_segments_start_past_the_previous_bucket() -> None:
    reqs = np.array([3.0, 6, 8, 12, 16, 72])
    cols = {"num_reqs": reqs, "num_tokens": reqs}  # plain decode: one query row per request
    bucket = np.array([4, 8, 8, 16, 16, 80])
    segs = padded_segments(cols, np.ones(6, bool), bucket, [1, 2, 4, 8, 16, 24, 64, 80])
    assert segs == [(3.0, 4.0), (5.0, 8.0), (9.0, 16.0), (65.0, 80.0)]
    xs, breaks = with_steps([1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 72.0], segs)
    # 80 has no row: no step there; 3 is a row and a segment's start
    assert breaks == [3.0, 5.0, 9.0] and xs == [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 72]
    spec = {"num_reqs": np.array([6.0]), "num_tokens": np.array([24.0])}  # 3 drafts a row
    assert padded_segments(spec, np.ones(1, bool), np.array([8]), [4, 8]) == [(20.0, 32.0)]


def test_the_llama_1b_sweep_of_today(tmp_path: Path) -> None:
    """The grid `replay shapes --set model=llama3.2-1b --set num_kv_blocks=40000` times (whole:
    the default budget holds it; 32 cells past the cache), with graph padding and 0.5 % noise:
    held-back points and every batch size 1-256 through the sim's cost model."""
    from replay.analysis.shapes_plan import plan
    from sim.cost.splits import program_keys_fn

    cfg = Config(model="llama3.2-1b", num_kv_blocks=40_000)
    p = plan(cfg, 40_000, buckets=BUCKETS)
    assert len(p.batches) == p.grid_shapes
    keys = program_keys_fn(8, 132)

    def truth(s: dict[str, int], bucket: int) -> float:
        b, kv = s["num_reqs"], s["kv_read_tokens"]
        rows = 1.2 + 0.002 * bucket + 0.006 * max(0, bucket - 128)
        bulk = rows + 1.5e-5 * kv * (1 + 2 / (1 + b / 8))
        return max(bulk, rows + 3e-4 * keys(b, s["max_kv_tokens"]))

    rng = np.random.default_rng(1)
    rows = []
    for b in p.batches:
        s = batch_shape(b.entries)
        bucket = bucket_of(len(b.entries)) if b.kind == "decode" else 0
        ms = truth(s, bucket) if bucket else 1.3 * mixed_truth(s)
        sample = Sample(ms * (1 + 0.005 * rng.standard_normal()), 0.1, 0.2)
        wrapped = b.blocks(16) > 40_000
        rows.append(shape_row(b, [sample], 0, bucket, b.max_seq_len, b.blocks(16), wrapped))
    assert sum(r["kv_wrapped"] for r in rows) > 10
    meta = {"format": "replay.shapes", "version": FORMAT_VERSION, "model": "llama3.2-1b",
            "gpu": H100, "dtype": "bfloat16", MEASURES_KEY: MEASURES_STEP,
            "graph_buckets": BUCKETS}  # fmt: skip
    f = write_sweep(tmp_path / "s.parquet", rows, meta)
    cal = calibrate([eager_run(tmp_path / "r", seed=0, cfg=cfg)], shapes=[f])
    assert cal.verdict.endswith("within 5 % everywhere"), cal.verdict
    assert cal.quality["gpu_pass.held_back"]["regions"]["decode all"]["max_rel"] < 0.03
    cm = CostModel(cfg, cal.profile)
    err = []
    for b in range(1, 257):
        for ctx in (100, 700, 2000):
            s = batch_shape([Entry(ctx - 1, 1, False)] * b)
            got = cm.gpu_pass_ms(BatchShape(**{k: s[k] for k in SHAPE_FIELDS}))
            err.append(abs(got / truth(s, bucket_of(b)) - 1))
    assert max(err) < 0.03, max(err)
