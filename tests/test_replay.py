"""replay compare and calibrate on runs with known answers (no engine, no GPU).

`synthetic_run` plays a synchronous engine loop over random batches whose every CPU phase and
GPU pass costs a known linear function of the batch shape, and writes it with RunRecorder /
write_run like a measured run. Calibrating from such runs must give those coefficients back;
comparing a run with a copy whose clock runs 10 % slower must give exactly the implied errors.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import Config
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import RunRecorder, load_run, write_run
from bubblesim.core.runfmt.metrics import flat_metrics
from bubblesim.core.shape import BatchShape
from replay.analysis.calibrate import calibrate, evaluate, write_calibration
from replay.analysis.compare import TARGETS, compare_runs
from replay.analysis.lsq import fit, nnls_lawson_hanson
from replay.analysis.report import write_report
from sim.cost import CostModel, load_profile, validate_profile

TRACE = {"path": "synthetic.parquet", "sha256": "ab" * 32, "rows": 0}
GPU = "NVIDIA H100 80GB HBM3"
# ms; the true cost model of the synthetic engine
GPU_DECODE = {"intercept": 0.8, "num_tokens": 0.004, "kv_read_tokens": 2e-5}
GPU_MIXED = {"intercept": 1.2, "num_tokens": 0.02, "num_reqs": 0.01}
PHASES = {
    "schedule": {"intercept": 0.05, "num_reqs": 0.012, "new_reqs": 0.03},
    "prepare_inputs": {"intercept": 0.2, "num_reqs": 0.02, "context_tokens": 3e-6},
    "sample": {"intercept": 0.07, "num_reqs": 0.002},
    "draft": {},
    "process_outputs": {"intercept": 0.04, "num_reqs": 0.009},
}
LAUNCH_GRAPH_MS, LAUNCH_EAGER_MS, LAUNCH_PER_REQ = 0.03, 1.5, 0.001
GC_MS = 0.25  # a gen-0 pause inside process_outputs every 7th step


def _lin(model: dict[str, float], s: BatchShape) -> float:
    return sum(
        c * (s.num_tokens if t == "num_tokens" else 1.0 if t == "intercept" else getattr(s, t))
        for t, c in model.items()
    )


def synthetic_run(
    out: Path,
    seed: int = 0,
    scale: float = 1.0,
    noise: float = 0.0,
    n_req: int = 24,
    cfg: Config | None = None,
    phases=PHASES,
) -> Path:
    """A depth-1 engine loop: schedule, prepare, launch, sample, draft, [GPU], process."""
    rng = np.random.default_rng(seed)
    cfg = cfg or Config(model="tiny")
    arrival = np.sort(rng.uniform(0, 0.05, n_req))
    prompt = rng.integers(8, 300, n_req)
    out_len = rng.integers(2, 40, n_req)
    rec = RunRecorder()
    for i, a in enumerate(arrival):
        rec.add_request(f"r{i}", a * scale)
    done = np.zeros(n_req, np.int64)  # tokens emitted
    t = 0.0
    step = 0

    def jitter() -> float:
        return 1.0 + noise * rng.standard_normal() if noise else 1.0

    while (done < out_len).any():
        live = [i for i in range(n_req) if arrival[i] <= t and done[i] < out_len[i]][:12]
        if not live:
            t = float(min(arrival[i] for i in range(n_req) if done[i] < out_len[i]))
            continue
        pre = [i for i in live if done[i] == 0]
        ctx = [int(prompt[i] + done[i]) for i in live]
        s = BatchShape(
            num_reqs=len(live),
            num_prefill_reqs=len(pre),
            prefill_tokens=int(sum(prompt[i] for i in pre)),
            decode_tokens=len(live) - len(pre),
            kv_read_tokens=sum(ctx),
            attn_pairs=sum(c * c for c in ctx),
            history_tokens=int(sum(done[i] for i in live)),  # as if all need their history
            context_tokens=sum(ctx),
            new_reqs=len(pre),
        )
        k = rec.add_step(s)
        for ph in ("schedule", "prepare_inputs"):
            d = _lin(phases[ph], s) * jitter() / 1e3
            rec.phase(k, ph, t * scale, (t + d) * scale)
            t += d
        graph = s.num_prefill_reqs == 0
        d = ((LAUNCH_GRAPH_MS if graph else LAUNCH_EAGER_MS) + LAUNCH_PER_REQ * s.num_reqs) / 1e3
        rec.phase(k, "launch", t * scale, (t + d) * scale)
        t += d
        gpu_s = _lin(GPU_MIXED if s.num_prefill_reqs else GPU_DECODE, s) * jitter() / 1e3
        for ph in ("sample", "draft"):
            d = _lin(phases[ph], s) * jitter() / 1e3
            rec.phase(k, ph, t * scale, (t + d) * scale)
            t += d
        g0 = t  # the GPU runs the step once the host has issued all of it: kernels alone
        rec.gpu(k, g0 * scale, (g0 + gpu_s) * scale)
        if g0 + gpu_s > t:
            rec.sync(k, t * scale, (g0 + gpu_s) * scale)
            t = g0 + gpu_s
        d = _lin(phases["process_outputs"], s) * jitter() / 1e3
        t0 = t
        if step % 7 == 3:
            rec.gc_pause((t + d / 2) * scale, GC_MS / 1e3 * scale, 0, "process_outputs", k)
            d += GC_MS / 1e3
        t += d
        rec.phase(k, "process_outputs", t0 * scale, t * scale)
        for i in live:
            rec.tokens(i, t * scale)
            done[i] += 1
            if done[i] == out_len[i]:
                rec.finish(i, t * scale)
        step += 1
    write_run(out, rec, config=cfg, trace=TRACE, source={"kind": "replay", "gpu": GPU})
    return out


def small_trace(folder: Path) -> Path:
    from bubblesim.core.trace import make_trace, write_trace

    rng = np.random.default_rng(5)
    arrival = np.sort(rng.uniform(0, 0.2, 12))
    t = make_trace(arrival, rng.integers(16, 200, 12), rng.integers(4, 30, 12))
    return write_trace(t, folder / "small.parquet")


# ---- compare ------------------------------------------------------------------------------------
def test_compare_identical_runs_is_exact(tmp_path: Path):
    a = load_run(synthetic_run(tmp_path / "a"))
    b = load_run(synthetic_run(tmp_path / "b"))
    fid = compare_runs(a, b)
    assert fid["passed"]
    for name, m in fid["metrics"].items():
        assert m["rel_error"] in (0.0, None), name
    assert fid["steps"]["fraction_identical"] == 1.0
    assert fid["steps"]["gpu_ms_error"]["all"]["abs_error_ms"]["p99"] == 0.0
    assert fid["requests"]["matched"] == 24 and fid["requests"]["output_tokens_equal"]


def test_compare_two_sim_runs_of_one_trace_is_exact(tmp_path: Path):
    pytest.importorskip("simpy")
    from sim.run import simulate

    trace = small_trace(tmp_path)
    for name in ("a", "b"):
        simulate(Config(model="tiny", num_kv_blocks=4096), trace, tmp_path / name)
    fid = compare_runs(load_run(tmp_path / "a"), load_run(tmp_path / "b"))
    assert fid["passed"] and fid["notes"] == [] and fid["config_differences"] == {}
    errors = [m["rel_error"] for m in fid["metrics"].values()]
    assert all(e in (0.0, None) for e in errors) and errors.count(0.0) > 20
    assert fid["steps"]["fraction_identical"] == 1.0 and fid["steps"]["same_num_steps"]
    assert fid["requests"]["e2e_s"]["abs_rel_error"]["p99"] == 0.0


def test_compare_slower_clock_gives_the_implied_errors(tmp_path: Path):
    pred = load_run(synthetic_run(tmp_path / "p"))
    meas = load_run(synthetic_run(tmp_path / "m", scale=1.1))  # everything 10 % slower
    fid = compare_runs(pred, meas)
    m = fid["metrics"]
    assert m["output_tok_per_s"]["rel_error"] == pytest.approx(0.1, rel=1e-9)
    for key in ("tpot_s.p50", "tpot_s.p99", "ttft_s.p50", "e2e_s.p50", "gpu_ms_mean"):
        assert m[key]["rel_error"] == pytest.approx(1 / 1.1 - 1, rel=1e-9), key
    assert m["bubble_fraction"]["abs_error_points"] == pytest.approx(0.0, abs=1e-9)
    assert m["bubble_fraction"]["error_kind"] == "absolute_points"
    t = fid["targets"]
    assert not t["output_tok_per_s"]["passed"] and t["bubble_fraction"]["passed"]
    assert not fid["passed"]
    st = fid["steps"]
    assert st["fraction_identical"] == 1.0  # the same batches, only slower
    assert st["gpu_ms_error"]["all"]["rel_error"]["p50"] == pytest.approx(1 / 1.1 - 1)
    rq = fid["requests"]["e2e_s"]["rel_error"]
    assert rq["p50"] == pytest.approx(1 / 1.1 - 1) and rq["p99"] == pytest.approx(1 / 1.1 - 1)


def test_compare_counts_steps_with_other_batches(tmp_path: Path):
    pred = load_run(synthetic_run(tmp_path / "p", n_req=24))
    meas = load_run(synthetic_run(tmp_path / "m", n_req=24, seed=1))
    fid = compare_runs(pred, meas)
    assert fid["steps"]["fraction_identical"] < 0.5
    assert fid["steps"]["first_difference"] == 0


def test_compare_reads_errors_against_the_repeat_spread(tmp_path: Path):
    pred = load_run(synthetic_run(tmp_path / "p"))
    meas_dir = synthetic_run(tmp_path / "m", scale=1.02)
    s = json.loads((meas_dir / "summary.json").read_text())
    s["repeat_spread"] = {
        "output_tok_per_s": {"range_rel": 0.05},
        "tpot_s.p50": {"range_rel": 0.01},
    }
    (meas_dir / "summary.json").write_text(json.dumps(s))
    m = compare_runs(pred, load_run(meas_dir))["metrics"]
    assert m["output_tok_per_s"]["within_spread"] is True
    assert m["tpot_s.p50"]["within_spread"] is False


def test_fidelity_report_and_plots(tmp_path: Path):
    pred = load_run(synthetic_run(tmp_path / "p"))
    meas = load_run(synthetic_run(tmp_path / "m", scale=1.05))
    fid = compare_runs(pred, meas)
    out = tmp_path / "fid"
    out.mkdir()
    md = write_report(fid, pred, meas, out).read_text()
    for name in TARGETS:
        assert f"| {name} |" in md
    images = [
        line.rsplit("(", 1)[1].rstrip(")") for line in md.splitlines() if line.startswith("![")
    ]
    assert len(images) == 7
    for img in images:
        if img.endswith(".svg"):
            ET.parse(out / img)  # well-formed SVG
        assert (out / img).stat().st_size > 200
    json.dumps(fid, allow_nan=False)


def test_compare_refuses_runs_of_different_traces(tmp_path: Path):
    from replay.analysis.compare import CompareError

    a = synthetic_run(tmp_path / "a")
    b = synthetic_run(tmp_path / "b")
    s = json.loads((b / "summary.json").read_text())
    s["trace"]["sha256"] = "cd" * 32
    (b / "summary.json").write_text(json.dumps(s))
    with pytest.raises(CompareError, match="different traces"):
        compare_runs(load_run(a), load_run(b))


def test_compare_cli_writes_a_whole_folder(tmp_path: Path, capsys):
    from replay.__main__ import main

    a, b = synthetic_run(tmp_path / "a"), synthetic_run(tmp_path / "b", scale=1.2)
    assert main(["compare", str(a), str(b), "-o", str(tmp_path / "f")]) == 0
    assert "FAIL" in capsys.readouterr().out
    assert main(["compare", str(a), str(b), "-o", str(tmp_path / "f"), "--strict"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "f"]  # no temp folder left
    assert json.loads((tmp_path / "f" / "fidelity.json").read_text())["metrics"]


# ---- least squares ------------------------------------------------------------------------------
def test_nnls_fallback_matches_scipy():
    scipy_opt = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(3)
    for _ in range(100):
        a = rng.normal(size=(int(rng.integers(3, 40)), int(rng.integers(1, 7))))
        b = rng.normal(size=a.shape[0])
        x = nnls_lawson_hanson(a, b)
        assert (x >= 0).all()
        ref = scipy_opt.nnls(a, b)[0]
        assert np.linalg.norm(a @ x - b) == pytest.approx(np.linalg.norm(a @ ref - b), abs=1e-9)


def test_fit_keeps_coefficients_non_negative():
    x = np.column_stack([np.ones(50), np.arange(50.0)])
    y = 5.0 - 0.1 * np.arange(50.0)  # the best unconstrained slope is negative
    f = fit(x, y)
    assert f.coef[1] == 0.0 and f.coef[0] == pytest.approx(y.mean())


# ---- calibrate ----------------------------------------------------------------------------------
def test_calibrate_recovers_known_coefficients(tmp_path: Path):
    runs = [synthetic_run(tmp_path / f"r{i}", seed=i, n_req=30) for i in range(3)]
    cal = calibrate(runs)
    p = cal.profile
    validate_profile(p)
    assert p["gpu"] == "h100" and p["model"] == "tiny" and p["dtype"] == "bfloat16"
    assert p["source_runs"] == [str(r) for r in runs]
    for kind, true in (("decode", GPU_DECODE), ("mixed", GPU_MIXED)):
        got = p["gpu_pass"][kind]
        for term, coef in true.items():
            assert got.get(term, 0.0) == pytest.approx(coef, rel=1e-6), (kind, term)
    for phase, true in PHASES.items():
        if not true:
            continue
        cm = CostModel(Config(model="tiny"), p)
        for s in (
            BatchShape(num_reqs=3, decode_tokens=3, context_tokens=900),
            BatchShape(num_reqs=5, num_prefill_reqs=2, prefill_tokens=300, new_reqs=2),
        ):
            assert cm.cpu_phase_ms(phase, s) == pytest.approx(_lin(true, s), rel=1e-6), phase
    assert p["launch"]["graph_ms"] == pytest.approx(LAUNCH_GRAPH_MS, rel=1e-6)
    assert p["launch"]["eager_ms"] == pytest.approx(LAUNCH_EAGER_MS, rel=1e-6)
    assert p["cpu_phases"]["launch"]["num_reqs"] == pytest.approx(LAUNCH_PER_REQ, rel=1e-6)
    assert p["gc"]["pause_ms"][0] == pytest.approx(GC_MS)  # and GC taken out of the phase
    for name, q in cal.quality.items():
        if q["n"] and q["r2"] is not None:
            assert q["r2"] > 0.999999, name


def test_calibrate_with_noise_is_close_and_checks_on_other_runs(tmp_path: Path):
    train = [synthetic_run(tmp_path / f"t{i}", seed=i, noise=0.05, n_req=40) for i in range(3)]
    test = [synthetic_run(tmp_path / f"c{i}", seed=10 + i, noise=0.05, n_req=40) for i in range(2)]
    cal = calibrate(train)
    dec = cal.profile["gpu_pass"]["decode"]
    assert dec["intercept"] == pytest.approx(GPU_DECODE["intercept"], rel=0.05)
    check = evaluate(cal.profile, [load_run(d) for d in test])
    for name in ("gpu_pass.decode", "cpu_phases.prepare_inputs", "cpu_phases.schedule"):
        assert abs(check[name]["total_rel_error"]) < 0.03, name
        assert check[name]["mean_abs_rel_error"] < 0.1, name


def test_calibrate_fits_a_seed_term_from_an_ablation(tmp_path: Path):
    """Seed 3 off in one run, on in another: each side's term is a column block of its own
    (term fields x "term active"), so the forward scan's cost per history token comes back."""
    scan_ns = 5.0  # the synthetic engine's forward scan: 5 ns per history token
    off_phases = {**PHASES, "sample": {**PHASES["sample"], "history_tokens": scan_ns * 1e-6}}
    on = synthetic_run(tmp_path / "on", seed=1)
    off = synthetic_run(
        tmp_path / "off",
        seed=2,
        phases=off_phases,
        cfg=Config(model="tiny", reverse_placeholder_scan=False),
    )
    cal = calibrate([on, off])
    terms = cal.profile["terms"]
    assert terms["sample.forward_placeholder_scan"]["history_tokens"] == pytest.approx(
        scan_ns * 1e-6, rel=1e-6
    )
    assert terms["sample.reverse_placeholder_scan"]["num_reqs"] == pytest.approx(0, abs=1e-9)
    base = cal.profile["cpu_phases"]["sample"]
    assert base == pytest.approx(PHASES["sample"], rel=1e-6)
    # the sim then predicts each side as measured
    for c, phases in (
        (Config(model="tiny"), PHASES),
        (Config(model="tiny", reverse_placeholder_scan=False), off_phases),
    ):
        cm = CostModel(c, cal.profile)
        s = BatchShape(num_reqs=8, decode_tokens=8, history_tokens=4000)
        assert cm.cpu_phase_ms("sample", s) == pytest.approx(_lin(phases["sample"], s))


def test_calibrated_profile_loads_in_sim_and_moves_predictions(tmp_path: Path):
    pytest.importorskip("simpy")
    from sim.run import simulate

    slow = {ph: {t: 20 * c for t, c in m.items()} for ph, m in PHASES.items()}
    runs = [synthetic_run(tmp_path / f"r{i}", seed=i, phases=slow) for i in range(2)]
    cal = calibrate(runs)
    prof = tmp_path / "prof.json"
    side = write_calibration(cal, prof, {})
    assert load_profile(prof) == cal.profile and json.loads(side.read_text())["fit"]
    trace = small_trace(tmp_path)
    cfg = Config(model="tiny", num_kv_blocks=4096)
    base = simulate(cfg, trace, tmp_path / "base").summary
    cal_run = simulate(cfg.replace(profile=str(prof)), trace, tmp_path / "cal").summary
    # CPU phases 20x the defaults' order of magnitude: slower tokens, more bubbles
    assert cal_run["tpot_s"]["p50"] > 2 * base["tpot_s"]["p50"]
    assert cal_run["cpu_ms_mean"]["prepare_inputs"] > 3 * base["cpu_ms_mean"]["prepare_inputs"]


def test_calibrate_refuses_mixed_models(tmp_path: Path):
    from replay.analysis.calibrate import CalibrationError

    a = synthetic_run(tmp_path / "a")
    b = synthetic_run(tmp_path / "b", cfg=Config(model="small"))
    with pytest.raises(CalibrationError, match="models"):
        calibrate([a, b])


def test_calibrate_cli(tmp_path: Path, capsys):
    from replay.__main__ import main

    runs = [str(synthetic_run(tmp_path / f"r{i}", seed=i)) for i in range(2)]
    check = str(synthetic_run(tmp_path / "c", seed=9))
    prof = tmp_path / "p.json"
    assert main(["calibrate", *runs, "-o", str(prof), "--check", check]) == 0
    out = capsys.readouterr().out
    assert "cpu_phases.prepare_inputs" in out and "check on 1 other run" in out
    validate_profile(json.loads(prof.read_text()))
    fitrep = json.loads((tmp_path / "p.fit.json").read_text())
    assert fitrep["check"]["gpu_pass.decode"]["n"] > 0


def test_flat_metrics_names_every_cpu_phase():
    names = flat_metrics({})
    for ph in CPU_PHASES:
        assert f"cpu_ms_mean.{ph}" in names
