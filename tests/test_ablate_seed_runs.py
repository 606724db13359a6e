"""What the seed runs of 2026-11-26 (H200, reports/ablate.md) showed the calibration and the
ablation verdicts must handle, on small known cases (no engine, no GPU):
- a GPU interval the host paced (eager launch, or sampling enqueued after a long sample phase)
  is not kernel time: too few steps holding kernels alone keep the roofline;
- graph launches cost what graph launches cost, not the per-request cost of eager ones, and
  a graph's first (uploading) replay is not its per-step cost;
- with speculative decoding only uniform verify batches replay a CUDA graph;
- a measured side is each metric's median over repeats, and a change inside the repeats'
  noise is said to be so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import Config
from bubblesim.core.phases import CPU_PHASES, LAUNCH
from bubblesim.core.runfmt import codec
from bubblesim.core.shape import BatchShape
from replay.analysis.calibrate import _fit_launch, calibrate
from replay.analysis.steps import Steps
from replay.gpu.ablate import _measured_side, agreement, noise
from sim.cost import CostModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_replay import synthetic_run  # noqa: E402


def _shift_gpu_start(run: Path, to_phase: str, kind: str | None = None) -> None:
    """Move every step's GPU start to the start of `to_phase` (the host still enqueues work
    after it), as a host-paced step records it; optionally relabel the run's source kind."""
    t = codec.read_table(run / "steps.parquet")
    cols = {n: t.column(n) for n in t.column_names}
    cols["gpu_start_s"] = cols[f"{to_phase}_start_s"]
    codec.write_table(type(t).from_pydict(cols, schema=t.schema), run / "steps.parquet")
    if kind:
        s = json.loads((run / "summary.json").read_text())
        s["source"]["kind"] = kind
        (run / "summary.json").write_text(json.dumps(s))


def test_host_paced_gpu_intervals_keep_the_roofline(tmp_path: Path):
    run = synthetic_run(tmp_path / "r", seed=1, n_req=30)
    assert "decode" in calibrate([run]).profile["gpu_pass"]  # GPU after the host: fitted
    _shift_gpu_start(run, "sample")  # the GPU began before the sampling was enqueued
    cal = calibrate([run])
    assert "decode" not in cal.profile.get("gpu_pass", {})
    assert any("gpu_pass.decode: only 0 of" in n and "roofline" in n for n in cal.notes)


def test_sim_runs_need_only_the_launch_rule(tmp_path: Path):
    """A sim pass never waits for the sample phase: its intervals are kernels alone."""
    run = synthetic_run(tmp_path / "r", seed=1, n_req=30)
    _shift_gpu_start(run, "sample", kind="sim")
    assert "decode" in calibrate([run]).profile["gpu_pass"]


def _launch_steps(graph: np.ndarray, num_reqs: np.ndarray, launch_ms: np.ndarray) -> Steps:
    n = len(graph)
    cols = {"num_reqs": num_reqs.astype(float), "num_tokens": 4.0 * num_reqs}
    cols["intercept"] = np.ones(n)
    phase_ms = {p: np.full(n, np.nan) for p in CPU_PHASES}
    phase_ms[LAUNCH] = launch_ms
    return Steps(cols, phase_ms, np.ones(n), np.ones(n, bool), graph, np.zeros(n, np.int64))


def test_graph_launches_do_not_take_the_eager_per_request_cost():
    """Seed 4's before side: mostly eager launches whose cost grows with the batch, a few
    graph replays (two of them first replays that upload the graph)."""
    rng = np.random.default_rng(0)
    eager_n = rng.integers(1, 17, 200)
    graph_n = np.array([4, 4, 4, 3, 2, 2, 1, 1, 1, 1, 1, 1])
    graph_ms = np.full(12, 0.025)
    graph_ms[[0, 4]] = 0.33
    steps = _launch_steps(
        np.r_[np.zeros(200, bool), np.ones(12, bool)],
        np.r_[eager_n, graph_n],
        np.r_[6.0 + 0.1 * eager_n, graph_ms],
    )
    prof, resid = _fit_launch(steps)
    cm_graph = prof["graph_ms"] + sum(
        c * 16 * (4 if f == "num_tokens" else 1) for f, c in resid.items()
    )
    assert cm_graph == pytest.approx(0.025, abs=2e-3)  # was ~0.4 ms: 0.025 per request
    assert prof["eager_ms"] == pytest.approx(6.0 + 0.1 * eager_n.mean(), rel=0.02)


def test_spec_steps_replay_a_graph_only_with_k_drafts_each():
    cm = CostModel(Config(model="tiny").replace(**{"spec.method": "ngram-cpu", "spec.k": 3}))
    full = BatchShape(num_reqs=4, decode_tokens=16, draft_tokens=12, kv_read_tokens=400)
    short = BatchShape(num_reqs=4, decode_tokens=14, draft_tokens=10, kv_read_tokens=400)
    assert cm.graphed(full, True) and not cm.graphed(short, True)
    assert cm.launch_ms(short, True) > cm.launch_ms(full, True)
    plain = CostModel(Config(model="tiny"))
    assert plain.graphed(BatchShape(num_reqs=4, decode_tokens=4, kv_read_tokens=400), True)


def _summary(values: dict[str, list[float]], chosen: int) -> dict:
    reps = [{m: v[i] for m, v in values.items()} for i in range(len(next(iter(values.values()))))]
    top = {"output_tok_per_s": reps[chosen]["output_tok_per_s"]}
    top["tpot_s"] = {"p50": reps[chosen]["tpot_s.p50"]}
    return {**top, "repeats": {"count": len(reps), "chosen": chosen, "metrics": reps}}


def test_measured_side_is_the_median_of_each_metric():
    """Seed 5: the repeat of median throughput had the slowest TPOT of the three."""
    s = _summary({"output_tok_per_s": [277.6, 273.4, 272.4], "tpot_s.p50": [1.54, 1.86, 1.44]}, 1)
    side = _measured_side(s, Path("x"))
    assert side["metrics"]["output_tok_per_s"] == 273.4
    assert side["metrics"]["tpot_s.p50"] == 1.54  # not the chosen run's 1.86
    assert side["repeats"]["tpot_s.p50"] == [1.54, 1.86, 1.44]


def test_noise_is_robust_to_a_compile_repeat_and_flags_small_changes():
    # seed 4, e2e p50: the first off repeat paid Triton compiles
    se = noise([4.736, 1.745, 1.886], [0.757, 0.693, 0.641])
    assert se is not None and 2 * se < 0.6
    assert noise([1.0], [1.1]) is None
    meas = {"rel_change": {"tpot_s.p50": -0.10, "e2e_s.p50": -0.6}}
    meas["noise"] = {"tpot_s.p50": 0.08, "e2e_s.p50": 0.05}
    pred = {"rel_change": {"tpot_s.p50": 0.002, "e2e_s.p50": -0.55}}
    a = agreement(meas, pred)
    assert a["tpot_s.p50"]["resolved"] is False and not a["tpot_s.p50"]["same_sign"]
    assert a["e2e_s.p50"]["resolved"] is True and a["e2e_s.p50"]["within_target"]
