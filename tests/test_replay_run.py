"""`replay run` / `replay ablate` on CPU with the tiny model: complete runs with exactly the trace's
output lengths, the sim's token-emission convention, and interrupted runs left whole but marked
incomplete."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from bubblesim.core.config import Config  # noqa: E402
from bubblesim.core.runfmt import load_run  # noqa: E402
from bubblesim.core.trace import make_trace, write_trace  # noqa: E402
from replay.gpu.run import ReplayTimeout, replay  # noqa: E402

CPU_TINY = Config(model="tiny", device="cpu")
OUTPUT_LENS = [5, 3, 7, 4, 6]


@pytest.fixture(scope="module")
def few(tmp_path_factory: pytest.TempPathFactory) -> Path:
    t = make_trace(
        [0.0, 0.004, 0.008, 0.012, 0.03],
        [20, 35, 8, 50, 12],
        OUTPUT_LENS,
        request_id=np.array(["a", "b", "c", "d", "e"], dtype=object),
        needs_history=np.array([True, False, True, False, False]),
    )
    return write_trace(t, tmp_path_factory.mktemp("trace") / "few.parquet")


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_replay_run_cpu_is_a_complete_run(few: Path, tmp_path: Path):
    res = replay(CPU_TINY, few, tmp_path / "run")
    run = load_run(tmp_path / "run")
    assert run.complete and run.summary["source"]["kind"] == "replay"
    assert run.summary["source"]["gpu"].startswith("cpu")
    req = run.arrays("requests")
    got = dict(zip(req["request_id"].tolist(), req["output_tokens"].tolist()))
    assert got == dict(zip("abcde", OUTPUT_LENS))  # exactly the trace's output lengths
    assert np.isfinite(req["finish_s"]).all()
    steps = run.arrays("steps")
    assert run.summary["num_steps"] == len(steps["step"]) > 0
    # the sim's convention: tokens are emitted at the end of a process_outputs phase
    ends = set(steps["process_outputs_end_s"].tolist())
    assert set(req["first_token_s"].tolist()) <= ends
    assert set(req["finish_s"].tolist()) <= ends
    assert np.isfinite(steps["gpu_start_s"]).all()
    for phase in ("schedule", "prepare_inputs", "launch", "sample", "process_outputs"):
        assert np.isfinite(steps[f"{phase}_start_s"]).all(), phase
    inst = res.summary["replay"]["instrumentation"]
    assert inst["per_step_us"] > 0 and inst["overhead_fraction"] < 0.05
    assert res.summary["replay"]["requests_arrived"] == 5
    assert _leftovers(tmp_path) == []


def test_replay_repeat_reports_the_spread(few: Path, tmp_path: Path, capsys):
    from replay.__main__ import main

    out = tmp_path / "rep"
    args = ["run", str(few), "--set", "device=cpu", "--set", "model=tiny", "-o", str(out)]
    assert main([*args, "--repeat", "2", "-q"]) == 0
    assert "spread output_tok_per_s" in capsys.readouterr().out
    s = load_run(out).summary
    sp = s["repeat_spread"]
    assert sp["output_tok_per_s"]["n"] == 2 and sp["tpot_s.p50"]["range_rel"] is not None
    assert s["repeats"]["count"] == 2 and len(s["repeats"]["output_tok_per_s"]) == 2


def test_replay_out_of_time_leaves_an_incomplete_run(few: Path, tmp_path: Path):
    out = tmp_path / "partial"
    with pytest.raises(ReplayTimeout):
        replay(CPU_TINY, few, out, max_seconds=1e-3)
    run = load_run(out)  # a whole, readable run folder
    assert not run.complete
    assert "ReplayTimeout" in run.summary["replay"]["interrupted"]
    assert _leftovers(tmp_path) == []  # no temp folder, nothing half-written


def test_replay_engine_error_leaves_what_was_measured(few: Path, tmp_path: Path):
    out = tmp_path / "err"
    with pytest.raises(RuntimeError, match="injected"):
        replay(CPU_TINY, few, out, fail_after_steps=3)
    run = load_run(out)
    assert not run.complete and run.summary["num_steps"] >= 3
    assert run.summary["replay"]["unfinished_requests"] > 0
    req = run.arrays("requests")
    assert (req["output_tokens"] > 0).any()
    assert _leftovers(tmp_path) == []


def test_replay_cli_bad_input_is_one_line(few: Path, tmp_path: Path, capsys):
    from bubblesim.core.cli import run_main
    from replay.__main__ import main

    args = ["run", str(few), "--set", "device=cpu", "--set", "model=tiny", "--set", "bogus=1"]
    assert _exit_code(lambda: run_main(main, args)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bogus" in err[0]
    assert not (tmp_path / "x").exists()


def _exit_code(fn) -> int:
    try:
        return fn()
    except SystemExit as e:
        return int(e.code)


def test_ablate_measures_beside_the_prediction(few: Path, tmp_path: Path):
    pytest.importorskip("simpy")
    from replay.gpu.ablate import ablate

    cfg = CPU_TINY.replace(arrival="asap", num_kv_blocks=4096)  # the same KV cache in both
    out = tmp_path / "abl"
    res = ablate(cfg, few, out, ["reverse_placeholder_scan", "accepted_count_by_sum"], repeat=1)
    assert "skipped" in res["accepted_count_by_sum"]  # no effect without spec decoding
    sw = res["reverse_placeholder_scan"]
    for kind in ("measured", "predicted"):
        assert set(sw[kind]["off"]) == set(sw[kind]["on"]), kind
        assert sw[kind]["rel_change"]["output_tok_per_s"] is not None, kind
    assert load_run(out / "reverse_placeholder_scan-off").complete
    assert load_run(out / "reverse_placeholder_scan-on.sim").summary["source"]["kind"] == "sim"
    assert json.loads((out / "ablate.json").read_text()) == json.loads(json.dumps(res))


@pytest.mark.slow
def test_interleaved_sides_take_turns_and_keep_their_repeats(few: Path, tmp_path: Path):
    """replay_interleaved: off, on, off, on (host drift hits both sides alike); each side's
    folder is the median of its own repeats, with their spread."""
    from replay.gpu.run import replay_interleaved

    cfg = CPU_TINY.replace(arrival="asap", num_kv_blocks=4096)
    cfgs = {"off": cfg.replace(reverse_placeholder_scan=False), "on": cfg}
    outs = {side: tmp_path / side for side in cfgs}
    said: list[str] = []
    res = replay_interleaved(cfgs, few, outs, 2, progress=said.append)
    rounds = [m for m in said if m.startswith("round")]
    assert [m.split(":")[0] for m in rounds] == [
        "round 1/2 off", "round 1/2 on", "round 2/2 off", "round 2/2 on"
    ]  # fmt: skip
    for side in cfgs:
        run = load_run(outs[side])
        assert run.complete and run.summary["repeats"]["count"] == 2
        assert run.summary["config"]["reverse_placeholder_scan"] == (side == "on")
        assert len(res[side].repeats) == 2


def test_to_recorder_conventions():
    """Hand-made hook record: the GPU start moves to the launch, token stamps to the end of
    their process_outputs phase, GC pauses keep their phase; a GPU interval with no end event
    (an interrupted step) is dropped; tokens of one step count as accepted drafts."""
    from types import SimpleNamespace

    from bubblesim.core.phases import CPU_PHASES
    from bubblesim.core.runfmt.records import RunRecorder
    from bubblesim.core.shape import BatchShape
    from replay.gpu.measure import to_recorder

    ms = 1_000_000
    t0 = 5 * ms
    ph = np.full((2, len(CPU_PHASES), 2), -1, np.int64)
    for row, base in ((0, t0), (1, t0 + 10 * ms)):
        for j in range(len(CPU_PHASES)):  # phase j of a row runs over [base + j ms, + 1 ms]
            ph[row, j] = (base + j * ms, base + (j + 1) * ms)
    gpu = np.array([[t0 + 1 * ms, t0 + 4 * ms], [t0 + 11 * ms, -1]], np.int64)
    trace = SimpleNamespace(
        t0_ns=t0,
        num_steps=2,
        shapes=[BatchShape(num_reqs=1, num_prefill_reqs=1, prefill_tokens=4), BatchShape()],
        phase_ns=ph,
        gpu_ns=gpu,
        sync_ns=np.array([[t0 + 5 * ms + 10, t0 + 5 * ms + 20]], np.int64),
        sync_row=np.array([0]),
        gc_ns=np.array([[t0 + 3 * ms, t0 + 3 * ms + 500]], np.int64),
        gc_generation=np.array([1]),
        gc_activity=np.array([3]),
        gc_row=np.array([0]),
    )
    po_mid = t0 + 5 * ms + 500_000  # inside row 0's process_outputs [5, 6] ms
    out = SimpleNamespace(
        request_id="x", arrival_ns=t0, token_ns=[po_mid], finish_ns=po_mid, num_preemptions=0
    )
    spec = SimpleNamespace(
        request_id="y",
        arrival_ns=t0,
        token_ns=[po_mid, po_mid, po_mid],
        finish_ns=-1,
        num_preemptions=1,
    )  # 1 sampled + 2 accepted drafts
    conv = to_recorder(trace, [out, spec])
    assert isinstance(conv.recorder, RunRecorder) and conv.dropped_gpu_rows == 1
    rec = conv.recorder.freeze()
    assert rec.gpu_start[0] == pytest.approx(0.002)  # launch start (phase 2), not the event
    assert np.isnan(rec.gpu_start[1])
    assert rec.first_token[0] == pytest.approx(0.006) and rec.finish[0] == pytest.approx(0.006)
    assert rec.gc_phase[0] == CPU_PHASES[3] and rec.gc_gen[0] == 1
    assert conv.gpu_start_moved_ns[0] == ms
    assert rec.output_tokens.tolist() == [1, 3] and rec.req_accepted.tolist() == [0, 2]
    assert rec.accepted.tolist() == [2, 0] and rec.preemptions.tolist() == [0, 1]
    assert conv.unfinished == 1 and np.isnan(rec.finish[1])


@pytest.mark.gpu
def test_gpu_replay_and_calibrate(few: Path, tmp_path: Path):
    """On CUDA: a complete run whose hooks cost ~1 % of the step time at most, GPU intervals that
    never start before their launch, and a profile fitted from it."""
    from replay.analysis.calibrate import calibrate
    from sim.cost import validate_profile

    cfg = Config(model="small", device="cuda", arrival="asap", num_kv_blocks=4096)
    res = replay(cfg, few, tmp_path / "run", repeat=2)
    run = load_run(tmp_path / "run")
    assert run.complete and "cpu" not in run.summary["source"]["gpu"]
    inst = res.summary["replay"]["instrumentation"]
    print("instrumentation", inst)  # target < 1 %; asserted loosely against host noise
    assert inst["overhead_fraction"] < 0.02
    s = run.arrays("steps")
    assert (s["gpu_start_s"] >= s["launch_start_s"]).all()
    assert (np.diff(s["gpu_start_s"]) > 0).all()
    validate_profile(calibrate([tmp_path / "run"]).profile)


def test_a_cuda_run_records_the_gpu_preset_it_ran_on(monkeypatch):
    import replay.gpu.run as rr
    from bubblesim.core.config import Config

    cfg = Config(device="cuda", gpu="h100")
    monkeypatch.setattr(rr, "gpu_name", lambda c: "NVIDIA H200")
    assert rr.as_run(cfg).gpu == "h200"
    monkeypatch.setattr(rr, "gpu_name", lambda c: "NVIDIA H100 80GB HBM3")
    assert rr.as_run(cfg) is cfg
    monkeypatch.setattr(rr, "gpu_name", lambda c: "NVIDIA GeForce RTX 4090")  # no preset
    assert rr.as_run(cfg).gpu == "h100"
    assert rr.as_run(Config(device="cpu", gpu="a100")).gpu == "a100"
