"""reports/fidelity/tail_share.py: per decode graph bucket, the ms per tail key a decode(mix)
sweep measures (spread - control), for each order, given back from a synthetic sweep."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.models import get_model
from replay.analysis.shapes_grid import MIX_FAMILIES, Limits
from sim.cost.splits import tail_keys_fn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "reports" / "fidelity"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_sweep import mix_batches, write_timed  # noqa: E402
from tail_share import at_bucket, per_bucket  # noqa: E402

LIM = Limits(max_tokens=8192, max_seqs=256, max_len=131072, kv_tokens=20000 * 16)
TAIL = tail_keys_fn(get_model("llama3-8b").kv_heads_per_rank(1), 132)
US_PER_KEY = {MIX_FAMILIES[0]: {8: 0.8, 80: 0.1}, MIX_FAMILIES[1]: {8: 0.6, 80: -0.2}}


def _sweep(path: Path) -> Path:
    timed = []
    for b, s in mix_batches(LIM):
        n = s["num_reqs"]
        keys = TAIL(n, s["kv_read_tokens"], s["max_kv_tokens"])
        ms = 5.0 + 0.01 * n + 3e-5 * s["kv_read_tokens"]
        timed.append((b, ms + US_PER_KEY[b.label].get(n, 0.3) * 1e-3 * keys))
    return write_timed(path, timed)


def test_each_order_and_bucket_comes_back(tmp_path: Path) -> None:
    tables = per_bucket(_sweep(tmp_path / "mix.parquet"))
    assert list(tables) == ["shuffled", "longest first"]
    buckets = [b for b in LIM.decode_buckets() if b >= 8]
    for name, fam in zip(tables, MIX_FAMILIES, strict=True):
        assert list(tables[name]) == buckets
        for b, ms in tables[name].items():
            assert ms * 1e3 == pytest.approx(US_PER_KEY[fam].get(b, 0.3), rel=1e-6), (name, b)


def test_a_batch_takes_the_first_swept_bucket_at_or_above_it() -> None:
    table = {8: 1.0, 16: 2.0, 80: 3.0}
    got = at_bucket(table, np.array([1, 8, 9, 16, 17, 80, 500]))
    assert got.tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0]
