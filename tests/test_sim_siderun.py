"""The extra runs of `sim run --seeds` / `--host-band` (sim.siderun): on a pool they give what
they give one after another, in the order added; a run's error reaches the caller; the
temporary folder goes; a bad --jobs is one line with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import sigterm_while_busy

from bubblesim.core.config import load_config
from sim.__main__ import main
from sim.siderun import SideRuns

ROOT = Path(__file__).resolve().parents[1]
STATES = ROOT / "reports/fidelity/gen/l/profile-h100-llama3.2-1b-states.json"  # host states
SMOKE = str(ROOT / "traces/smoke.parquet")
BASE = ["run", SMOKE, "--set", "model=llama3.2-1b", "--set", "gpu=h100", "-q"]


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def test_a_pool_gives_what_one_after_another_gives(tmp_path: Path) -> None:
    args = [*BASE, "--set", f"profile={STATES}", "--seeds", "3", "--host-band"]
    assert main([*args, "--jobs", "1", "-o", str(tmp_path / "one")]) == 0
    assert main([*args, "--jobs", "3", "-o", str(tmp_path / "pool")]) == 0
    one, pool = _summary(tmp_path / "one"), _summary(tmp_path / "pool")
    assert pool["seed_spread"] == one["seed_spread"]
    assert pool["host_band"] == one["host_band"]
    assert one["seed_spread"]["seeds"] == [0, 1, 2]
    fast, slow = one["host_band"]["fast"], one["host_band"]["slow"]
    assert slow["host_scale"] > fast["host_scale"]  # two different runs, each in its place
    assert {k: v for k, v in one.items() if k != "sim"} == {
        k: v for k, v in pool.items() if k != "sim"
    }  # the rest of the summary too ("sim" holds wall times)


@pytest.mark.parametrize("jobs", [1, 2])
def test_results_come_in_the_order_added(jobs: int) -> None:
    cfg = load_config(None, ["model=llama3.2-1b", "gpu=h100"])
    configs = [cfg.replace(max_num_seqs=n) for n in (1, 64, 4)]
    lines: list[str] = []
    with SideRuns(SMOKE, None, jobs, len(configs)) as side:
        for c in configs:
            side.add(f"seqs {c.max_num_seqs}", c)
        got = side.results(lines.append)
        folder = side.folder
        assert folder.is_dir()
    assert not folder.exists()  # the temporary folder goes at the exit
    assert [s["config"]["max_num_seqs"] for s in got] == [1, 64, 4]  # each its own config's
    steps = [s["num_steps"] for s in got]
    assert steps[0] > max(steps[1:])  # and its own run: one row a step takes more steps
    assert len(lines) == 3 and all(line.startswith("seqs ") for line in lines)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_run_s_error_reaches_the_caller(jobs: int) -> None:
    cfg = load_config(None, ["model=llama3.2-1b", "gpu=h100"])
    with pytest.raises(ValueError, match="KV blocks"), SideRuns(SMOKE, None, jobs, 2) as side:
        side.add("fine", cfg)
        side.add("too few blocks", cfg.replace(num_kv_blocks=1))
        side.results(None)


def test_a_bad_jobs_count_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "sim", *BASE, "--seeds", "2", "--jobs", "0", "-o", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip() == "error: --jobs 0: expected 1 or more"
    assert not out.exists()


# SIGTERM to `sim run` alone (`kill PID`) while its extra runs are busy on the pool: the
# workers are stopped too, the command ends at once, and no temporary folder stays.
def test_sigterm_stops_the_extra_runs_too(tmp_path: Path) -> None:
    pids, tmp, runs = tmp_path / "pids", tmp_path / "tmp", tmp_path / "runs"
    pids.mkdir()
    tmp.mkdir()
    argv = [*BASE, "--seeds", "3", "--jobs", "2", "-o", str(runs / "out")]
    sigterm_while_busy("sim.siderun.side_summary", argv, pids, tmp_path, {"TMPDIR": str(tmp)})
    assert list(tmp.iterdir()) == []  # the extra runs' temporary folder went
    # the main run was done, but its folder waits for the extra runs' results: nothing half
    # written, and the parent folder made for it went too
    assert not runs.exists()


def test_sigterm_while_extra_runs_leaves_an_earlier_folder_as_it_was(tmp_path: Path) -> None:
    pids, tmp, out = tmp_path / "pids", tmp_path / "tmp", tmp_path / "out"
    pids.mkdir()
    tmp.mkdir()
    assert main([*BASE, "--set", "seed=7", "-o", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = [*BASE, "--seeds", "3", "--jobs", "2", "-o", str(out)]
    sigterm_while_busy("sim.siderun.side_summary", argv, pids, tmp_path, {"TMPDIR": str(tmp)})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "pids", "tmp"]  # no temps
