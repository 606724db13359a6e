"""Simulator behaviour: invariants on every run, the effects the model exists to show,
determinism, a torch-free import and the `python -m sim run` command line.

Every run here goes through `run_checked`, which turns on the policy's invariant checks after
every step (no KV block double-booked) and checks the run folder: every request got exactly
its output_len tokens, the GPU never runs two passes at once, busy + bubble + idle = span.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sim.run as simrun
from bubblesim.core.config import load_config
from bubblesim.core.runfmt import Run, load_run
from bubblesim.core.trace import make_trace, write_trace
from sim.loop import SimLoop

ROOT = Path(__file__).resolve().parents[1]


def trace_file(tmp: Path, name: str, arrival: object, prompt: object, output: object,
               **cols: object) -> Path:  # fmt: skip
    n = len(np.atleast_1d(np.asarray(output)))
    arr = np.broadcast_to(np.asarray(arrival, np.float64), (n,))
    t = make_trace(arr, np.broadcast_to(prompt, (n,)), np.broadcast_to(output, (n,)), **cols)
    return write_trace(t, tmp / f"{name}.parquet")


def run_checked(
    tmp: Path, trace: Path, sets: list[str], name: str = "run", fast_forward: bool = True
) -> Run:
    """simulate() with invariant checks after every step (every fast-forwarded segment), then
    the run-folder checks."""
    orig = simrun.SimLoop

    def make(*args: object, **kw: object) -> SimLoop:
        return SimLoop(*args, check_invariants=True, fast_forward=fast_forward, **kw)  # type: ignore[arg-type]

    simrun.SimLoop = make  # type: ignore[assignment,misc]
    try:
        simrun.simulate(load_config(None, sets), trace, tmp / name)
    finally:
        simrun.SimLoop = orig  # type: ignore[misc]
    run = load_run(tmp / name)
    check_run(run, trace)
    return run


def check_run(run: Run, trace: Path) -> None:
    t = pq.read_table(trace)
    want = dict(zip(t.column("request_id").to_pylist(), t.column("output_len").to_pylist()))
    got = dict(
        zip(run.requests.column("request_id").to_pylist(), run.requests.column("output_tokens"))
    )
    assert {k: int(v.as_py()) for k, v in got.items()} == want, "tokens not all accounted"
    assert np.isfinite(run.arrays("requests")["finish_s"]).all(), "a request never finished"
    steps = run.arrays("steps")
    g0, g1 = steps["gpu_start_s"], steps["gpu_end_s"]
    order = np.argsort(g0, kind="stable")
    assert (g0[order][1:] >= g1[order][:-1]).all(), "two GPU passes overlap"
    assert (g1 >= g0).all()
    s = run.summary
    assert s["gpu_busy_s"] + s["bubble_s"] + s["idle_s"] == pytest.approx(s["span_s"], rel=1e-9)
    assert s["num_finished"] == s["num_requests"]


# ---- behaviours ---------------------------------------------------------------------------------
def test_cpu_bound_depth_two_hides_part_of_the_cpu(tmp_path: Path) -> None:
    """llama3.2-1b at batch 128: the CPU phases of a step outlast its GPU pass. With two batches
    in flight the next step's CPU work overlaps the GPU: fewer bubbles than synchronous."""
    trace = trace_file(tmp_path, "big", 0.0, 256, [60] * 128)
    sets = ["model=llama3.2-1b", "max_num_seqs=128", "num_kv_blocks=4000"]
    bubble = {}
    for depth in (1, 2):
        run = run_checked(tmp_path, trace, [*sets, f"batches_in_flight={depth}"], f"d{depth}")
        bubble[depth] = run.summary["bubble_fraction"]
    assert bubble[1] > 0.3, "the case is meant to be CPU-bound"
    assert bubble[2] < bubble[1] - 0.05


def test_gpu_bound_depth_two_drives_bubbles_near_zero(tmp_path: Path) -> None:
    """llama3-8b: every CPU phase is shorter than the GPU pass, so with two batches in flight
    the GPU always has the next step queued; synchronously it idles for the CPU work."""
    trace = trace_file(tmp_path, "spread", np.arange(48) * 0.05, 512, [120] * 48)
    sets = ["model=llama3-8b", "num_kv_blocks=3000"]
    sync = run_checked(tmp_path, trace, [*sets, "batches_in_flight=1"], "d1")
    two = run_checked(tmp_path, trace, [*sets, "batches_in_flight=2"], "d2")
    assert sync.summary["bubble_fraction"] > 0.05
    assert two.summary["bubble_fraction"] < 0.01


def test_history_scan_makes_bubbles_grow_late(tmp_path: Path) -> None:
    """Seed 3: `list.index(-1)` from the front scans each request's output history every step.
    Its cost grows with the history, so on a GPU-bound model bubbles appear only late in long
    generations and grow step after step; the reverse scan stays O(1) and bubble-free.
    The per-token cost is raised in a profile (0.5 us instead of 1.4 ns) so that a 2,000-token
    run shows what 60,000-token generations at batch 128 show with the default."""
    profile = tmp_path / "scan.json"
    profile.write_text(
        json.dumps(
            {"version": 1, "terms": {"sample.forward_placeholder_scan": {"history_tokens": 5e-4}}}
        )
    )
    n = 16
    trace = trace_file(tmp_path, "hist", 0.0, 128, [1500] * n, needs_history=np.ones(n, dtype=bool))
    sets = ["model=llama3-8b", "num_kv_blocks=3000", f"profile={profile}"]
    fwd = run_checked(tmp_path, trace, [*sets, "reverse_placeholder_scan=false"], "fwd")
    rev = run_checked(tmp_path, trace, [*sets, "reverse_placeholder_scan=true"], "rev")
    b = np.nan_to_num(fwd.arrays("steps")["bubble_before_s"])[1:]  # after the prefill step
    quarters = [q.mean() for q in np.array_split(b, 4)]
    assert quarters[0] < 1e-6, "no bubbles while the scan is short"
    assert quarters[1] < quarters[2] < quarters[3], "bubble per step grows with the history"
    assert fwd.summary["bubble_s_by_cause"]["sample"] > 0.5 * fwd.summary["bubble_s"]
    assert rev.summary["bubble_fraction"] < 0.01


# ---- invariants under pressure --------------------------------------------------------------
@pytest.mark.parametrize(
    "sets",
    [
        ["model=llama3-8b", "num_kv_blocks=200", "batches_in_flight=1"],
        ["model=llama3-8b", "num_kv_blocks=200", "batches_in_flight=3", "max_num_seqs=12"],
        ["model=tiny", "num_kv_blocks=150", "max_num_batched_tokens=256", "gc_freeze=false"],
        ["model=llama3-8b", "num_kv_blocks=300", "spec.method=ngram-gpu"],
        ["model=llama3-8b", "num_kv_blocks=300", "spec.method=ngram-cpu"],
    ],
    ids=lambda s: " ".join(s),
)
@pytest.mark.parametrize("fast_forward", [False, True], ids=["step", "ff"])
def test_invariants_hold_under_preemption_and_chunking(
    tmp_path: Path, sets: list[str], fast_forward: bool
) -> None:
    rng = np.random.default_rng(3)
    n = 40
    trace = trace_file(
        tmp_path,
        "burst",
        np.sort(rng.uniform(0, 0.5, n)),
        rng.integers(50, 700, n),
        rng.integers(1, 150, n),
        accept_rate=rng.uniform(0, 1, n).astype(np.float32),
    )
    run = run_checked(tmp_path, trace, sets, fast_forward=fast_forward)
    if "num_kv_blocks=200" in sets:
        assert run.requests.column("preemptions").to_numpy().sum() > 0


# ---- determinism, import, command line --------------------------------------------------------
def test_same_input_gives_byte_identical_steps(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    n = 50
    trace = trace_file(tmp_path, "t", np.sort(rng.uniform(0, 3, n)), rng.integers(20, 900, n),
                       rng.integers(1, 200, n))  # fmt: skip
    sets = ["model=llama3-8b", "num_kv_blocks=500"]
    a = run_checked(tmp_path, trace, sets, "a")
    b = run_checked(tmp_path, trace, sets, "b")
    for name in ("steps.parquet", "requests.parquet", "gc.parquet"):
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name


def test_importing_sim_does_not_import_torch() -> None:
    code = (
        "import sys, sim, sim.run, sim.loop, sim.fast, sim.cli, sim.__main__\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _sim_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "sim", "run", *args], capture_output=True, text=True, cwd=cwd,
        env=env, timeout=300,
    )  # fmt: skip


def test_cli_run_end_to_end(tmp_path: Path) -> None:
    trace = trace_file(tmp_path, "tiny", np.arange(8) * 0.01, 32, [16] * 8)
    out = tmp_path / "out"
    res = _sim_cli(str(trace), "-o", str(out), "-q", "--set", "model=tiny", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    run = load_run(out)
    assert run.summary["num_finished"] == 8
    check_run(run, trace)
    assert "output tok/s" in res.stdout


@pytest.mark.parametrize("bad", ["trace", "config"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, bad: str) -> None:
    trace = trace_file(tmp_path, "ok", np.arange(4) * 0.01, 32, [16] * 4)
    sets = ["--set", "model=tiny"]
    if bad == "trace":
        table = pq.read_table(trace)
        lens = pa.array([16, 0, 16, 16], pa.int32())
        table = table.set_column(table.column_names.index("output_len"), "output_len", lens)
        trace = tmp_path / "bad.parquet"
        pq.write_table(table, trace)
    else:
        sets += ["--set", "batches_in_flight=7"]
    out = tmp_path / "out"
    res = _sim_cli(str(trace), "-o", str(out), "-q", *sets, cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert ("output_len" if bad == "trace" else "batches_in_flight") in lines[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")], "temp left behind"


# ---- behind a router ---------------------------------------------------------------------------
def _replica(cfg_sets: list[str], trace: Path, env: object) -> SimLoop:
    """What simulate() builds, on a shared SimPy environment."""
    from bubblesim.core.gpus import get_gpu
    from bubblesim.core.models import get_model, with_context
    from bubblesim.core.policy import Scheduler
    from bubblesim.core.policy.sizing import kv_blocks_for_gpu, scheduler_config
    from bubblesim.core.runfmt import RunRecorder
    from bubblesim.core.trace import read_trace
    from sim.cost import load_cost_model
    from sim.gcmodel import GCModel

    cfg = load_config(None, cfg_sets)
    model = with_context(get_model(cfg.model), cfg.max_model_len)
    t = read_trace(trace, model)
    cost = load_cost_model(cfg)
    blocks = kv_blocks_for_gpu(cfg, model, get_gpu(cfg.gpu).memory_bytes)
    requests = simrun.build_requests(t)
    rec = RunRecorder()
    for r in requests:
        rec.add_request(r.request_id, r.arrival_s)
    gc = GCModel(cfg.gc, cfg.gc_freeze, cost.gc_pause_ms)
    sched = Scheduler(scheduler_config(cfg, model, blocks))
    accept = simrun.acceptance_for(cfg, t)
    return SimLoop(cfg, sched, cost, rec, requests, accept, gc, None, env, check_invariants=True)  # type: ignore[arg-type]


def test_router_replicas_match_their_own_runs(tmp_path: Path) -> None:
    """Two replicas on one SimPy environment, fed through `start(own_arrivals=False)` and
    `submit` by a router process, run exactly as each would alone on its share of the trace."""
    import simpy

    rng = np.random.default_rng(4)
    n = 60
    arrival = np.sort(rng.uniform(0, 3, n))
    prompt, output = rng.integers(20, 900, n), rng.integers(1, 150, n)
    parts = [
        trace_file(tmp_path, f"part{j}", arrival[j::2], prompt[j::2], output[j::2])
        for j in range(2)
    ]
    sets = ["model=llama3-8b", "num_kv_blocks=400"]
    env = simpy.Environment()
    loops = [_replica(sets, p, env) for p in parts]

    def router() -> object:
        queue = sorted((r.arrival_s, j, r.index) for j, lp in enumerate(loops) for r in lp.requests)
        for arrival_s, j, i in queue:
            if arrival_s > env.now:
                yield env.timeout(arrival_s - env.now)
            loops[j].submit(loops[j].requests[i])

    env.process(router())
    done = [lp.start(own_arrivals=False) for lp in loops]
    env.run(until=env.all_of(done))
    for lp, part in zip(loops, parts, strict=True):
        alone = simrun.simulate(load_config(None, sets), part).recorder.freeze()
        shared = lp.rec.freeze()
        assert shared.num_steps == alone.num_steps
        for name in ("gpu_start", "gpu_end", "first_token", "finish"):
            np.testing.assert_allclose(getattr(shared, name), getattr(alone, name), rtol=1e-9)
        np.testing.assert_array_equal(shared.shape, alone.shape)
