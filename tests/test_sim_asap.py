"""`arrival=asap` in the simulator: every request is queued at time 0, as replay queues them,
so throughput is the engine's own (the maximum-throughput check of the fidelity protocol)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.test_sim import run_checked, trace_file

SETS = ["model=llama3.2-1b", "gpu=h100", "max_num_seqs=64"]


def test_asap_queues_every_request_at_zero_and_runs_faster(tmp_path: Path) -> None:
    # 40 requests one second apart: in real time the engine mostly waits for arrivals
    trace = trace_file(tmp_path, "sparse", np.arange(40, dtype=float), 300, np.full(40, 50))
    real = run_checked(tmp_path, trace, SETS, "real")
    asap = run_checked(tmp_path, trace, [*SETS, "arrival=asap"], "asap")
    assert np.all(asap.requests["arrival_s"].to_numpy() == 0.0)
    assert real.requests["arrival_s"].to_numpy().max() == 39.0
    # the same work in far less time: the throughput is set by the engine, not the arrivals
    assert asap.summary["output_tok_per_s"] > 10 * real.summary["output_tok_per_s"]
    assert asap.summary["config"]["arrival"] == "asap"
    # every request still gets all its tokens (run_checked checks), in arrival-rank order
    ids = asap.requests["request_id"].to_pylist()
    assert ids == real.requests["request_id"].to_pylist()
