"""The idle-gap sweep (`replay idlegap`): its file, the law fitted from it, calibrate's use of it,
and the sweep itself on CPU (the plumbing: a CPU has no idle-start effect)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.analysis.calibrate import CalibrationError, idle_from_sweeps
from replay.analysis.idlegap_file import (
    IdleGapFileError,
    fit_idle_sweep,
    read_idlegap,
    write_idlegap,
)


def _rows(per: float, after: float, frac: float, seed: int = 0) -> list[dict]:
    """Samples of 6 shapes x 8 gaps x 3 repeats that follow the law, with small noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for shape, queued in enumerate([0.8, 1.1, 1.5, 2.0, 2.6, 3.3]):
        for gap in (0.05, 0.1, 0.2, 0.4, 0.7, 1.0, 1.5, 2.5):
            for _ in range(3):
                idle = gap + 0.04 + rng.uniform(0, 0.02)
                saved = min(per * max(idle - after, 0.0), frac * queued)
                rows.append(
                    dict(
                        shape=shape, label="decode", num_reqs=8 * (shape + 1), draft_tokens=0,
                        kv_read_tokens=4096 * (shape + 1), bucket=8 * (shape + 1),
                        gap_ms=gap, idle_ms=idle,
                        gpu_ms=queued - saved + rng.normal(0, 0.005),
                        queued_ms=queued, queued_samples=5,
                    )
                )  # fmt: skip
    return rows


def _write(path: Path, rows: list[dict], model: str = "llama3.2-1b", k: int = 0) -> Path:
    meta = {"format": "replay.idlegap", "model": model, "spec": {"method": "none", "k": k}}
    return write_idlegap(path, rows, meta)


def test_the_law_is_recovered_from_a_sweep(tmp_path: Path) -> None:
    f = _write(tmp_path / "ig.parquet", _rows(0.8, 0.25, 0.5))
    keys, report = fit_idle_sweep([f], "llama3.2-1b")
    assert keys["shrink_per_ms"] == pytest.approx(0.8, abs=0.06)
    assert keys["shrink_after_ms"] == pytest.approx(0.25, abs=0.06)
    assert keys["shrink_max_fraction"] == pytest.approx(0.5, abs=0.05)
    assert "verify_shrink_per_ms" not in keys
    r = report["decode"]
    assert r["abs_err_ms_law"] < 0.02 < r["abs_err_ms_none"]
    saved = {lo: s for lo, _hi, _n, s, _f in r["saved_ms_by_gap"]}
    assert saved[1.0] > saved[0.25] > saved[0.05]  # grows with the gap


def test_a_spec_sweep_gives_the_verify_law(tmp_path: Path) -> None:
    f = _write(tmp_path / "v.parquet", _rows(0.5, 0.3, 0.3), k=3)
    keys, _ = fit_idle_sweep([f])
    assert set(keys) == {"verify_shrink_per_ms", "verify_shrink_after_ms",
                         "verify_shrink_max_fraction"}  # fmt: skip
    assert keys["verify_shrink_max_fraction"] == pytest.approx(0.3, abs=0.05)


def test_no_saving_fits_no_law(tmp_path: Path) -> None:
    rows = _rows(0.0, 0.0, 0.05)
    f = _write(tmp_path / "flat.parquet", rows)
    keys, report = fit_idle_sweep([f])
    assert keys == {}
    assert "no saving measured" in report["decode"]["note"]


def test_calibrate_puts_the_sweep_law_over_the_runs(tmp_path: Path) -> None:
    f = _write(tmp_path / "ig.parquet", _rows(0.8, 0.25, 0.5))
    runs = {"scale": 1.0, "min_idle_ms": 0.05, "verify_shrink_per_ms": 0.9,
            "verify_shrink_after_ms": 0.3, "verify_shrink_max_fraction": 0.3}  # fmt: skip
    notes: list[str] = []
    table = idle_from_sweeps([f], "llama3.2-1b", runs, notes)
    assert table is not None
    assert table["shrink_per_ms"] == pytest.approx(0.8, abs=0.06)
    assert table["verify_shrink_per_ms"] == 0.9  # the runs' verify law stays
    assert any("replaces the runs' law" in n for n in notes)
    assert idle_from_sweeps([f], "llama3.2-1b", None, [])["min_idle_ms"] == 0.05


def test_bad_files_get_one_error_naming_them(tmp_path: Path) -> None:
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1]}), other)
    with pytest.raises(IdleGapFileError, match="other.parquet: not an idle-gap sweep"):
        read_idlegap(other)
    junk = tmp_path / "junk.parquet"
    junk.write_text("no")
    with pytest.raises(IdleGapFileError, match="junk.parquet: not a readable parquet"):
        read_idlegap(junk)
    f = _write(tmp_path / "ig.parquet", _rows(0.8, 0.25, 0.5), model="llama3-8b")
    with pytest.raises(CalibrationError, match="an idle-gap sweep of 'llama3-8b'"):
        idle_from_sweeps([f], "llama3.2-1b", None, [])


def test_the_sweep_runs_the_engine_on_cpu(tmp_path: Path) -> None:
    from bubblesim.core.config import load_config
    from replay.gpu.idlegap import sweep_idle

    cfg = load_config(sets=["model=tiny", "device=cpu"])
    res = sweep_idle(cfg, tmp_path / "ig.parquet", gaps_ms=(0.1, 1.0), repeats=2, shapes=2)
    cols, meta = read_idlegap(res.path)
    assert res.samples == len(cols["gpu_ms"]) == res.shapes * 2 * 2
    assert meta["model"] == "tiny" and meta["gaps_ms"] == [0.1, 1.0]
    assert set(cols["gap_ms"]) == {0.1, 1.0}
    one = cols["gap_ms"] == 1.0
    assert (cols["idle_ms"][one] >= 1.0).all()  # the host waited the gap before the step
    assert (cols["gpu_ms"] > 0).all() and (cols["queued_ms"] > 0).all()
