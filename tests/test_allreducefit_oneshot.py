"""`replay allreduce-fit` on a sweep with "oneshot" rows: gpu_pass.allreduce_oneshot fitted
from the sizes the rule sends to the one-shot kernel (the rest ignored), beside
gpu_pass.allreduce from the NCCL rows; a sweep without them writes no such key; a one-shot-only
sweep writes only it; too few usable rows give one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.cli import UsageError
from bubblesim.core.collectives import uses_oneshot
from bubblesim.core.config import Config
from bubblesim.core.gpus import get_gpu
from replay.__main__ import main as replay_main
from replay.analysis.allreducefit import (
    SweepFileError,
    fit_oneshot,
    fit_sweep_oneshot,
    read_sweep,
    write_sweep,
)
from sim.cost import CostModel, load_profile
from sim.cost.collective import Collectives

RING = {"latency_ms": 0.0072, "latency_ms_per_peer": 0.0021, "bw_efficiency": 0.73}
ONE = {"latency_ms": 0.0043, "bw_efficiency": 0.41}
SIZES = [2**k for k in range(10, 27)]  # 1 KiB .. 64 MiB


def _row(mode: str, n: int, b: int, ms: float) -> dict:
    return {"mode": mode, "world_size": n, "bytes": b, "iters": 10, "samples": 5, "ms": ms,
            "ms_min": ms, "ms_max": ms}  # fmt: skip


def rows(modes=("graph", "oneshot"), world_sizes=(2, 4, 8), noise=0.0) -> list[dict]:
    """NCCL rows from the ring model; "oneshot" rows from the one-shot model where the rule
    sends the size to the kernel, and something else entirely (3 x the ring) beyond, which the
    fit must ignore."""
    rng = np.random.default_rng(9)
    out = []
    for mode in modes:
        for n in world_sizes:
            ring = Collectives(get_gpu("h100"), n, RING)
            one = Collectives(get_gpu("h100"), n, RING, ONE, "oneshot")
            for b in SIZES:
                if mode != "oneshot":
                    ms = ring.allreduce_ms(b)
                elif uses_oneshot("oneshot", b, n):
                    ms = one.oneshot_ms(b)
                else:
                    ms = 3 * ring.allreduce_ms(b)
                out.append(_row(mode, n, b, ms * (1 + noise * rng.standard_normal())))
    return out


def _arrays(rs: list[dict], mode: str = "oneshot"):
    sel = [r for r in rs if r["mode"] == mode]
    return (np.array([r[k] for r in sel]) for k in ("world_size", "bytes", "ms"))


def test_fit_recovers_the_one_shot_parameters_over_the_rule_s_sizes() -> None:
    res = fit_oneshot(*_arrays(rows()), link_gb_per_s=450.0)
    for k, v in ONE.items():
        assert res.params[k] == pytest.approx(v, rel=1e-6), k
    assert set(res.params) == {"latency_ms", "bw_efficiency"}
    # 1 KiB .. 2 MiB on 2 GPUs (12 sizes), 1 KiB .. 512 KiB on 4 and 8 (10 each)
    assert res.rows == 12 + 10 + 10 and res.world_sizes == [2, 4, 8]
    assert res.rms_rel < 1e-9 and not res.notes
    noisy = fit_oneshot(*_arrays(rows(noise=0.03)), link_gb_per_s=450.0)
    assert noisy.params["bw_efficiency"] == pytest.approx(0.41, rel=0.1)
    assert noisy.params["latency_ms"] == pytest.approx(0.0043, rel=0.1)


def test_fit_caps_and_refuses() -> None:
    n, b, ms = _arrays(rows())
    fast = fit_oneshot(n, b, ms, link_gb_per_s=450.0 / 3)  # faster than the link: capped
    assert fast.params["bw_efficiency"] == 1.0 and "capped at 1" in fast.notes[0]
    big = np.array([2, 4, 8]), np.array([2**24, 2**20, 2**20]), np.array([0.1, 0.1, 0.1])
    with pytest.raises(SweepFileError, match="3 or more timed calls of sizes the rule"):
        fit_oneshot(*big, link_gb_per_s=450.0)  # every size past the one-shot limits


def test_cli_writes_both_keys_and_the_sim_reads_them(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = write_sweep(tmp_path / "ar.parquet", rows(), {"gpu": "h100", "device": "synthetic"})
    assert replay_main(["allreduce-fit", str(path), "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "gpu_pass.allreduce: latency_ms 0.00720" in out
    assert "gpu_pass.allreduce_oneshot: latency_ms 0.00430" in out and "32 rows" in out
    prof = load_profile(tmp_path / "p.json")
    assert prof["gpu_pass"]["allreduce"]["bw_efficiency"] == pytest.approx(0.73, rel=1e-6)
    assert prof["gpu_pass"]["allreduce_oneshot"]["bw_efficiency"] == pytest.approx(0.41, rel=1e-6)
    assert "allreduce_oneshot fitted on 32 'oneshot' rows" in prof["notes"]
    cfg = Config(model="llama3-70b", gpu="h100", tensor_parallel_size=4, tp_allreduce="oneshot")
    cm = CostModel(cfg, prof)
    want = Collectives(get_gpu("h100"), 4, RING, ONE, "oneshot")
    for b in (2**12, 2**19, 2**22):  # one-shot, one-shot, ring
        assert cm.collectives.allreduce_ms(b) == pytest.approx(want.allreduce_ms(b), rel=1e-6)


def test_no_oneshot_rows_no_key_and_oneshot_only(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    nccl = write_sweep(tmp_path / "n.parquet", rows(("graph", "eager")), {"gpu": "h100"})
    assert replay_main(["allreduce-fit", str(nccl), "-o", str(tmp_path / "n.json")]) == 0
    assert "allreduce_oneshot" not in capsys.readouterr().out
    assert set(json.loads((tmp_path / "n.json").read_text())["gpu_pass"]) == {"allreduce"}
    with pytest.raises(SweepFileError, match="no 'oneshot' rows"):
        fit_sweep_oneshot(read_sweep(nccl))

    one = write_sweep(tmp_path / "o.parquet", rows(("oneshot",)), {"gpu": "h100"})
    assert replay_main(["allreduce-fit", str(one), "-o", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out
    assert "no 'graph' rows: gpu_pass.allreduce not fitted" in out
    assert set(json.loads((tmp_path / "o.json").read_text())["gpu_pass"]) == {"allreduce_oneshot"}


def test_too_few_oneshot_rows_is_one_error(tmp_path: Path) -> None:
    rs = [r for r in rows() if r["mode"] == "graph"]
    rs += [_row("oneshot", 4, 2**24, 0.2), _row("oneshot", 2, 2**10, 0.004)]  # 1 usable
    path = write_sweep(tmp_path / "few.parquet", rs, {"gpu": "h100"})
    out = tmp_path / "few.json"
    with pytest.raises(UsageError, match="one-shot fit needs 3 or more"):
        replay_main(["allreduce-fit", str(path), "-o", str(out)])
    assert not out.exists()  # nothing half-written
