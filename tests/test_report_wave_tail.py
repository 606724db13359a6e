"""reports/fidelity/wave_tail.py: the decode attention kernel's programs and their greedy
schedule, the makespan excess of a mixed batch, the fit that finds a synthetic sweep's slots and
cost back, and the rebuilding of each decode step's contexts from a run's records."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from replay.analysis.shapes_grid import Limits
from sim.cost.splits import program_keys_fn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reports" / "fidelity"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_sweep import mix_batches, write_timed  # noqa: E402
from test_sim_max_kv import _mixed_trace  # noqa: E402
from wave_tail import (  # noqa: E402
    contexts,
    excess,
    makespan,
    programs,
    row_contexts,
    sweep_fit,
)

HEADS, SMS, MAX_LEN = 8, 132, 131072


def _list_schedule(durations: list[float], slots: int) -> float:
    """The greedy schedule written out: each job on the slot that frees first (lowest index on
    a tie), slots scanned one by one."""
    free = [0.0] * slots
    end = 0.0
    for d in durations:
        i = min(range(slots), key=lambda j: (free[j], j))
        free[i] += d
        end = max(end, free[i])
    return end


def test_makespan_is_the_greedy_list_schedule() -> None:
    assert makespan([5.0] * 10, 4) == 15.0  # three waves
    assert makespan([5.0] * 8, 4) == 10.0
    assert makespan([], 4) == 0.0
    rng = np.random.default_rng(0)
    for _ in range(30):
        d = rng.integers(1, 50, int(rng.integers(1, 60))).astype(float).tolist()
        slots = int(rng.integers(1, 12))
        assert makespan(d, slots) == _list_schedule(d, slots)


@pytest.mark.parametrize("rows", [1, 8, 32, 33, 64, 128, 256])
@pytest.mark.parametrize("longest", [100, 4096, 4097, 12000, 40000])
def test_the_longest_program_is_the_simulators(rows: int, longest: int) -> None:
    """The split rule (engine decode_num_splits, with the graphs' key bound: the model's length)
    gives the longest program the keys sim.cost.splits.program_keys says."""
    ctx = [50] * (rows - 1) + [longest]
    progs = programs(ctx, rows, HEADS, MAX_LEN, SMS, 0.0)
    assert max(progs) == program_keys_fn(HEADS, SMS)(rows, longest)


def test_the_excess_of_a_batch() -> None:
    uniform = [1000] * 128
    assert excess(uniform, 128, HEADS, MAX_LEN, SMS, 528) == 0.0
    # one long row among short ones pays its tail: 128 rows x 8 heads fill 1.94 waves
    one_long = [1000] * 127 + [3000]
    ex = excess(one_long, 128, HEADS, MAX_LEN, SMS, 528)
    assert 0 < ex <= 3000 - 1000
    # 80 rows (640 programs: 1.2 waves of 528) hide a spread in the last wave's idle slots,
    # 128 (1.94 waves) cannot
    rng = np.random.default_rng(2)
    spread = {b: rng.permutation(np.linspace(500, 1500, b).round().astype(int)).tolist()
              for b in (80, 128)}  # fmt: skip
    assert excess(spread[80], 80, HEADS, MAX_LEN, SMS, 528) < 0.5 * excess(
        spread[128], 128, HEADS, MAX_LEN, SMS, 528
    )
    # longest first starts the long programs first
    mix = np.random.default_rng(1).permutation(np.linspace(200, 1800, 128).round().astype(int))
    desc = sorted(mix.tolist())[::-1]
    shuffled = excess(mix.tolist(), 128, HEADS, MAX_LEN, SMS, 528)
    assert excess(desc, 128, HEADS, MAX_LEN, SMS, 528) <= shuffled


@pytest.mark.slow
def test_the_sweep_fit_finds_a_synthetic_kernels_slots(tmp_path: Path) -> None:
    """A sweep whose spread points pay 0.7 us a key of the makespan excess at 4 blocks per SM:
    the fit gives 0.7 back with R^2 1, and every other slot count fits worse."""
    lim = Limits(max_tokens=8192, max_seqs=128, max_len=MAX_LEN, kv_tokens=20000 * 16)
    timed = []
    for b, s in mix_batches(lim):
        n = s["num_reqs"]
        ctx = [e.start + e.n for e in b.entries]  # the keys each row reads
        ms = 5.0 + 0.01 * n + 3e-5 * s["kv_read_tokens"]
        timed.append((b, ms + 0.7e-3 * excess(ctx, n, HEADS, MAX_LEN, SMS, 4 * SMS)))
    path = write_timed(tmp_path / "mix.parquet", timed)
    f = sweep_fit(path, None)
    assert f["slots"] == 4 * SMS and f["points"] > 20
    assert f["ms_per_key"] == pytest.approx(0.7e-3, rel=1e-9)
    assert f["r2"] == pytest.approx(1.0, abs=1e-12)
    assert all(r2 < f["r2"] for r2 in f["others"].values())
    assert f["tail_keys_r2"] < 0.99


def test_contexts_rebuilt_from_a_run_match_its_records(tmp_path: Path) -> None:
    """On a simulated run (no preemption), every decode step's rebuilt contexts add up to its
    recorded rows and keys."""
    trace = _mixed_trace(tmp_path, 5)
    simrun.simulate(load_config(None, ["model=llama3-8b", "gpu=h100"]), trace, tmp_path / "run")
    run, s, rows = row_contexts(tmp_path / "run")
    assert len(rows) == run.arrays("requests")["request_id"].size
    decode = np.flatnonzero((s["num_prefill_reqs"] == 0) & (s["num_reqs"] > 0))
    assert decode.size > 100
    for j in decode.tolist():
        ctx = contexts(rows, j)
        assert len(ctx) == s["num_reqs"][j]
        assert sum(ctx) == s["kv_read_tokens"][j]
        assert max(ctx) == s["max_kv_tokens"][j]
