"""`replay ablate --calibrate-on off`: the simulator's profile is fitted on the measured "before"
side of a switch only (one-sided: the seed-3 scan and the seed-4 CPU proposer take their own
fields), then both sides are predicted with it. Known answers on synthetic runs, and the whole
pipeline on CPU with the tiny model (measure, reuse the measured folder, calibrate, predict)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import Config
from bubblesim.core.shape import BatchShape
from replay.analysis.calibrate import ONE_SIDED_FIELDS, calibrate
from sim.cost import CostModel, load_profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_replay import PHASES, _lin, synthetic_run  # noqa: E402

SCAN_MS = 5e-6  # the synthetic engine's forward scan: 5 ns per history token
SCAN_OFF = Config(model="tiny", reverse_placeholder_scan=False)


def test_one_sided_fit_gives_the_scan_to_its_term(tmp_path: Path):
    """Only the scan side measured: the term gets the history_tokens cost, the base sample
    model what the other side keeps; predicting the other side removes the measured scan."""
    phases = {**PHASES, "sample": {**PHASES["sample"], "history_tokens": SCAN_MS}}
    off = synthetic_run(tmp_path / "off", seed=3, phases=phases, cfg=SCAN_OFF)
    cal = calibrate([off], one_sided=ONE_SIDED_FIELDS)
    term = cal.profile["terms"]["sample.forward_placeholder_scan"]
    assert term["history_tokens"] == pytest.approx(SCAN_MS, rel=1e-6)
    assert cal.profile["cpu_phases"]["sample"] == pytest.approx(PHASES["sample"], rel=1e-6)
    s = BatchShape(num_reqs=8, decode_tokens=8, history_tokens=4000)
    on = CostModel(Config(model="tiny"), cal.profile)
    want = _lin(PHASES["sample"], s) + 8 * 0.3e-3  # + the default reverse scan
    assert on.cpu_phase_ms("sample", s) == pytest.approx(want, rel=1e-6)
    # without the rule the term is held at its default (13 ns, more than this engine's 5 ns):
    # nothing is fitted to it and the base cannot give the difference back
    plain = calibrate([off])
    assert "terms" not in plain.profile
    assert plain.profile["cpu_phases"]["sample"].get("history_tokens", 0.0) < SCAN_MS


def test_one_sided_fit_keeps_terms_that_vary_across_runs(tmp_path: Path):
    """With both sides in the fit the ordinary ablation fit applies (the rule only touches
    terms active in every run)."""
    phases = {**PHASES, "sample": {**PHASES["sample"], "history_tokens": SCAN_MS}}
    off = synthetic_run(tmp_path / "off", seed=3, phases=phases, cfg=SCAN_OFF)
    on = synthetic_run(tmp_path / "on", seed=4)
    a = calibrate([off, on], one_sided=ONE_SIDED_FIELDS).profile
    b = calibrate([off, on]).profile
    assert a["terms"] == b["terms"] and a["cpu_phases"] == b["cpu_phases"]


def test_base_profile_terms_are_what_the_fit_holds(tmp_path: Path):
    """A term held fixed is subtracted at the base profile's value, not the built-in one."""
    phases = {**PHASES, "sample": {**PHASES["sample"], "intercept": 0.07 + 0.02}}
    run = synthetic_run(tmp_path / "r", seed=5, phases=phases)  # reverse scan, 0.3 us/req
    base = {"version": 1, "terms": {"sample.reverse_placeholder_scan": {"intercept": 0.02}}}
    got = calibrate([run], base=base).profile["cpu_phases"]["sample"]
    assert got == pytest.approx(PHASES["sample"], rel=1e-6)


# ---- the pipeline on CPU with the tiny model --------------------------------------------------
@pytest.fixture(scope="module")
def spec_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bubblesim.core.trace import make_trace, write_trace

    t = make_trace([0.0] * 4, [24, 40, 16, 32], [12, 9, 14, 10])
    return write_trace(t, tmp_path_factory.mktemp("trace") / "spec.parquet")


@pytest.mark.slow
def test_ablate_calibrated_on_the_before_side(spec_trace: Path, tmp_path: Path):
    pytest.importorskip("torch")
    pytest.importorskip("simpy")
    from replay.__main__ import main
    from replay.gpu.ablate import ablate

    cfg = Config(model="tiny", device="cpu", arrival="asap", num_kv_blocks=2048)
    cfg = cfg.replace(**{"spec.method": "ngram-gpu", "spec.k": 2})
    meas = tmp_path / "meas"
    ablate(cfg, spec_trace, meas, ["spec.method"], repeat=1, predict=False)
    base = tmp_path / "base.json"  # what the before side cannot show: the after side's term
    base.write_text(json.dumps({"version": 1, "terms": {"draft.ngram_gpu_launch": {}}}))
    out = tmp_path / "pred"
    argv = [str(spec_trace), "--switches", "spec.method", "--measured", str(meas)]
    argv += ["--calibrate-on", "off", "--set", f"profile={base}", "-q", "-o", str(out)]
    for kv in ("model=tiny", "arrival=asap", "num_kv_blocks=2048", "spec.method=ngram-gpu"):
        argv += ["--set", kv]  # the measured runs' values (checked)
    assert main(["ablate", *argv]) == 0
    refused = json.loads((out / "ablate.json").read_text())["spec.method"]["measured"]
    assert "spec.k=2, this side needs 3" in refused["error"]
    argv += ["--set", "spec.k=2"]
    assert main(["ablate", *argv]) == 0
    res = json.loads((out / "ablate.json").read_text())["spec.method"]
    cal = res["calibration"]
    assert cal["calibrated_on"] == "off" and cal["runs"] == [str(meas / "spec_method-off")]
    prof = load_profile(cal["profile"])
    assert prof["model"] == "tiny" and prof["source_runs"] == cal["runs"]
    assert prof["terms"]["draft.ngram_gpu_launch"] == {}  # from the base profile
    assert set(prof["terms"]["draft.ngram_cpu"]) <= set(ONE_SIDED_FIELDS["draft.ngram_cpu"])
    assert res["measured"]["runs"]["off"] == str(meas / "spec_method-off")
    for side in ("off", "on"):
        sim = json.loads((out / f"spec_method-{side}.sim" / "summary.json").read_text())
        assert sim["config"]["profile"] == cal["profile"]
        assert sim["config"]["spec"]["method"] == ("ngram-cpu" if side == "off" else "ngram-gpu")
    a = res["agreement"]["output_tok_per_s"]
    m, p = (res[k]["rel_change"]["output_tok_per_s"] for k in ("measured", "predicted"))
    assert a["size_ratio"] == pytest.approx(p / m)
    assert a["same_sign"] == (np.sign(p) == np.sign(m))
    # a measured folder of another trace, or of the other switch value, is refused
    from bubblesim.core.trace import make_trace, write_trace
    from replay.gpu.ablate import _load_measured

    other = write_trace(make_trace([0.0], [5], [3]), tmp_path / "other.parquet")
    cpu = cfg.replace(**{"spec.method": "ngram-cpu"})
    with pytest.raises(ValueError, match="another trace"):
        _load_measured(meas / "spec_method-off", cpu, "spec.method", other)
    with pytest.raises(ValueError, match="spec.method='ngram-cpu'"):
        _load_measured(meas / "spec_method-off", cfg, "spec.method", spec_trace)


def test_a_one_sided_term_owns_its_field_even_where_a_base_field_repeats_it():
    """ngram-gpu on both sides of seed 5, one request a step: num_reqs is the intercept on
    these runs. The proposer's launch (measured 1.20 ms in the run, 1.39 ms by the engine
    bench) goes to its term, not to the base's num_reqs with the term held at the bench's."""
    from types import SimpleNamespace

    from replay.analysis.calibrate import fit_target
    from sim.cost.terms import TERM_NAMES

    n = 200
    rng = np.random.default_rng(0)
    ctx = rng.integers(100, 4000, n).astype(np.float64)
    cols = {"intercept": np.ones(n), "num_reqs": np.ones(n), "draft_tokens": np.full(n, 3.0),
            "context_tokens": ctx}  # fmt: skip
    active = {t: np.full(n, t == "draft.ngram_gpu_launch") for t in TERM_NAMES}
    steps = SimpleNamespace(cols=cols, active=active)
    y = 1.2 + 2e-5 * ctx
    defaults = {t: {"intercept": 1.39} for t in TERM_NAMES}
    rows = np.ones(n, bool)
    base = ("intercept", "num_reqs", "draft_tokens", "context_tokens")
    tf = fit_target(steps, y, rows, base, "draft", defaults, ONE_SIDED_FIELDS)
    assert tf.terms["draft.ngram_gpu_launch"]["intercept"] == pytest.approx(1.2)
    assert tf.model == pytest.approx({"context_tokens": 2e-5})
    # two-sided (no rule): the term stays at the bench's 1.39 and the base cannot go below 0
    held = fit_target(steps, y, rows, base, "draft", defaults)
    assert held.terms == {} and held.model.get("intercept", 0.0) == 0.0
