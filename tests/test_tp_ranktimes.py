"""The worker ranks' own launch record (engine.tp.ranktimes) at tensor_parallel_size 2 on CPU
(gloo): one row per step of the run, on rank 0's hooks rows, in order with rank 0's broadcast;
a new run starts a fresh record; replay writes it as ranks.parquet, whole or not at all."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import make_cfg

from bubblesim.core.config import Config
from bubblesim.core.runfmt import load_run
from bubblesim.core.trace import make_trace, write_trace
from engine.engine import Engine
from engine.hooks import PHASE
from engine.requests import RequestInput
from replay.analysis.ranks import RANKS_FILE, read_ranks, write_ranks
from replay.gpu.run import replay

pytestmark = pytest.mark.usefixtures("one_thread")


def _reqs(n: int) -> list[RequestInput]:
    return [RequestInput(f"r{i}", 10 + 7 * i, 5 + i % 3) for i in range(n)]


@pytest.mark.slow
def test_each_step_has_the_worker_launch_after_rank_0s_broadcast_and_runs_start_afresh():
    eng = Engine(make_cfg(tensor_parallel_size=2))
    try:
        eng.run(_reqs(6), arrival="asap")
        first = eng.trace
        eng.run(_reqs(2), arrival="asap")
        second = eng.trace
    finally:
        eng.close()
    for tr in (first, second):
        r = tr.rank_ns
        assert r.shape == (tr.num_steps, 5)
        assert (r[:, 0] == 1).all()
        assert r[:, 1].tolist() == list(range(tr.num_steps))  # rank 0's rows, in order
        b0 = tr.broadcast_ns[:, 0]
        assert (r[:, 2] >= b0).all()  # the header reached the worker after rank 0 began it
        assert (r[:, 3] >= r[:, 2]).all() and (r[:, 4] >= r[:, 3]).all()
        # one clock for both processes: no worker launch ends before rank 0's first launch
        launch = tr.phase_ns[:, PHASE["launch"]]
        assert (r[:, 4] >= launch[:, 0].min()).all()
    assert second.num_steps < first.num_steps  # the second record is the second run's alone


def test_write_and_read_ranks_round_trip(tmp_path: Path):
    t0 = 1_000_000_000
    rows = np.array([[1, 0, t0 + 10, t0 + 20, t0 + 50], [2, 0, t0 + 12, t0 + 22, t0 + 90],
                     [1, 1, t0 + 100, t0 + 110, t0 + 130]], np.int64)  # fmt: skip
    assert write_ranks(tmp_path, rows, t0) == tmp_path / RANKS_FILE
    got = read_ranks(tmp_path)
    assert got is not None
    assert got.rank.tolist() == [1, 2, 1] and got.step.tolist() == [0, 0, 1]
    assert got.launch_end_s.tolist() == pytest.approx([50e-9, 90e-9, 130e-9])
    last = got.last_end_s(3)
    assert last[:2] == pytest.approx([90e-9, 130e-9]) and np.isnan(last[2])


def test_no_record_writes_no_file_and_a_bad_file_names_itself(tmp_path: Path):
    assert write_ranks(tmp_path, np.zeros((0, 5), np.int64), 0) is None
    assert read_ranks(tmp_path) is None and not (tmp_path / RANKS_FILE).exists()
    pq.write_table(pa.table({"rank": [1], "step": [0]}), tmp_path / RANKS_FILE)
    with pytest.raises(ValueError, match=r"ranks\.parquet: missing column\(s\) recv_s"):
        read_ranks(tmp_path)


@pytest.mark.slow
def test_replay_writes_the_worker_launches_beside_the_steps(tmp_path: Path):
    t = make_trace([0.0, 0.003], [30, 12], [6, 4], request_id=np.array(["a", "b"], dtype=object))
    path = write_trace(t, tmp_path / "t.parquet")
    res = replay(Config(model="tiny", device="cpu", tensor_parallel_size=2), path, tmp_path / "run")
    run = load_run(tmp_path / "run")
    n = run.summary["num_steps"]
    got = read_ranks(tmp_path / "run")
    assert got is not None and res.summary["replay"]["tensor_parallel"]["rank_launches"] == n
    assert sorted(got.step.tolist()) == list(range(n)) and (got.rank == 1).all()
    s = run.arrays("steps")
    assert (got.launch_end_s >= got.launch_start_s).all()
    # the header leaves rank 0 after its prepare_inputs (then the broadcast)
    assert (got.recv_s >= s["prepare_inputs_end_s"][got.step] - 1e-9).all()
