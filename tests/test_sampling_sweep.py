"""The sampling sweep (`replay sampling`): its file, the `sampling` table fitted from it,
calibrate's use of it, the sweep itself on CPU (the plumbing), and the host term's level in
the attribution (replay.analysis.quality.sampling_host_ms)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bubblesim.core.config import Config, load_config
from bubblesim.core.runfmt import load_run
from bubblesim.core.trace import make_trace, write_trace
from replay.analysis.calibrate import CalibrationError, calibrate
from replay.analysis.quality import sampling_host_ms
from replay.analysis.sampling_file import (
    SamplingFileError,
    fit_sampling,
    read_sampling,
    write_sampling,
)
from replay.analysis.steps import load_steps
from sim.cost.profile import resolve_profile, validate_profile
from sim.cost.sampling import GREEDY, MODES, mode_tables

ROWS = (1, 8, 64)
META = {"model": "llama3.2-1b", "vocab": 1000}


def _ms(mode: str, path: str, what: str, g: int) -> float:
    """Known times: greedy 0.1 ms; mode i adds (i + 1) x 0.01 ms a row on the GPU, and 0.2,
    0.4 or 0.6 ms on the host at the three sizes (their median: 0.4)."""
    if mode == GREEDY:
        return 0.1
    i = list(MODES).index(mode)
    if what == "gpu_ms":
        return 0.1 + (i + 1) * 0.01 * g + (0.001 if path == "choose" else 0.0)
    return 0.1 + 0.2 * (1 + ROWS.index(g))


def _rows(skip: tuple[str, ...] = ()) -> list[dict]:
    return [
        {"mode": m, "path": p, "what": w, "rows": g, "ms": _ms(m, p, w, g)}
        for m in (GREEDY, *MODES)
        if m not in skip
        for p in ("sample", "choose")
        for w in ("gpu_ms", "host_ms")
        for g in ROWS
    ]


def test_the_table_is_each_mode_less_greedy(tmp_path: Path) -> None:
    f = write_sampling(tmp_path / "s.parquet", _rows(), META)
    table = fit_sampling(f, 1000)["sampling"]
    validate_profile({"version": 1, "sampling": table})
    assert table["vocab"] == 1000 and table["rows"] == list(ROWS)
    for i, mode in enumerate(MODES):
        assert table[mode]["gpu_ms"] == pytest.approx([(i + 1) * 0.01 * g for g in ROWS])
        assert table[mode]["spec_gpu_ms"] == pytest.approx(
            [(i + 1) * 0.01 * g + 0.001 for g in ROWS]
        )
        # the host: one call's launches at every size, the median of the sizes
        assert table[mode]["host_ms"] == pytest.approx([0.4] * 3)
        assert table[mode]["spec_host_ms"] == pytest.approx([0.4] * 3)


def test_bad_sweeps_get_one_error_naming_them(tmp_path: Path) -> None:
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1]}), other)
    with pytest.raises(SamplingFileError, match="other.parquet: not a sampling sweep"):
        read_sampling(other)
    junk = tmp_path / "junk.parquet"
    junk.write_text("no")
    with pytest.raises(SamplingFileError, match="junk.parquet: not a readable parquet"):
        read_sampling(junk)
    part = write_sampling(tmp_path / "part.parquet", _rows(skip=("top_p",)), META)
    with pytest.raises(SamplingFileError, match="part.parquet: no top_p sample gpu_ms at 1 rows"):
        fit_sampling(part)
    f = write_sampling(tmp_path / "s.parquet", _rows(), META)
    with pytest.raises(SamplingFileError, match="at a vocabulary of 1000 .'llama3.2-1b'., the "):
        fit_sampling(f, 128256)


CPU_TINY = Config(model="tiny", device="cpu", max_num_batched_tokens=64, max_model_len=512)


def test_the_sweep_runs_the_sampler_on_cpu(tmp_path: Path) -> None:
    from replay.gpu.sampling import sweep_sampling

    res = sweep_sampling(CPU_TINY, tmp_path / "s.parquet", max_rows=4, repeats=1)
    rows, meta = read_sampling(res.path)
    assert len(rows) == 3 * (1 + len(MODES)) * 6  # rows 1, 2, 4 x modes x paths x timings
    assert meta["model"] == "tiny" and meta["vocab"] == 512
    assert all(r["ms"] > 0 for r in rows)
    table = fit_sampling(res.path, 512)["sampling"]
    assert table["rows"] == [1, 2, 4]


def _tiny_run(out: Path, *sets: str) -> Path:
    from replay.gpu.run import replay

    trace = write_trace(make_trace([0.0, 0.004, 0.01], [30, 12, 40], [6, 9, 5]), out / "t.parquet")
    cfg = load_config(sets=["model=tiny", "device=cpu", "max_model_len=512", *sets])
    return replay(cfg, trace, out / "run", probe=False).out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny CPU replays, greedy and at top_p (eager: no graphs on CPU)."""
    return {
        "greedy": _tiny_run(tmp_path_factory.mktemp("greedy")),
        "top_p": _tiny_run(
            tmp_path_factory.mktemp("top_p"), "sampling.temperature=0.8", "sampling.top_p=0.9"
        ),
    }


def test_calibrate_takes_the_sweep_and_refuses_sampled_runs(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    f = write_sampling(tmp_path / "s.parquet", _rows(), {**META, "model": "tiny", "vocab": 512})
    cal = calibrate([runs["greedy"]], sampling_sweep=f)
    prof = validate_profile(cal.profile)
    assert prof["sampling"]["top_p"]["host_ms"] == pytest.approx([0.4] * 3)
    assert any("sampling" in n for n in cal.notes)
    with pytest.raises(CalibrationError, match="at a vocabulary of 1000"):
        other = write_sampling(tmp_path / "o.parquet", _rows(), META)
        calibrate([runs["greedy"]], sampling_sweep=other)
    # a sampled run's sample phase holds the term the simulator adds: the fit would count it
    # twice
    with pytest.raises(CalibrationError, match="samples at random .top_p.: calibrate from greedy"):
        calibrate([runs["greedy"], runs["top_p"]], sampling_sweep=f)


def test_the_attribution_counts_the_host_term(runs: dict[str, Path], tmp_path: Path) -> None:
    """replay.analysis.quality.sampling_host_ms: the sample-phase term the simulator adds, on
    every step of this eager run at its rows (the table x 512 / 1000, tiny's vocabulary); 0 on
    a greedy run."""
    f = write_sampling(tmp_path / "s.parquet", _rows(), {**META, "model": "tiny", "vocab": 512})
    prof = resolve_profile(calibrate([runs["greedy"]], sampling_sweep=f).profile)
    run = load_run(runs["top_p"])
    steps = load_steps([run])
    extra = sampling_host_ms(prof, [run], steps)
    tables = mode_tables(prof["sampling"], "top_p", 512)
    assert tables is not None
    reqs = steps.cols["num_reqs"]
    want = np.array([tables["host_ms"](float(r)) if r else 0.0 for r in reqs])
    assert np.allclose(extra, want) and (extra > 0).any()
    greedy = load_run(runs["greedy"])
    assert not sampling_host_ms(prof, [greedy], load_steps([greedy])).any()


@pytest.mark.gpu
def test_the_sweep_captures_every_mode_on_the_gpu(tmp_path: Path) -> None:
    """Every mode's sampler in a CUDA graph and eagerly, on the engine's own Sampler."""
    import torch

    from replay.gpu.sampling import sweep_sampling

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    cfg = Config(model="tiny", device="cuda", max_num_batched_tokens=64, max_model_len=512)
    res = sweep_sampling(cfg, tmp_path / "s.parquet", max_rows=64, repeats=3)
    rows, meta = read_sampling(res.path)
    assert meta["device"] == "cuda" and len(rows) == 7 * (1 + len(MODES)) * 6
    assert all(np.isfinite(r["ms"]) and r["ms"] > 0 for r in rows)
    table = fit_sampling(res.path, 512)["sampling"]
    validate_profile({"version": 1, "sampling": table})
