"""A trace's own scenario (bubblesim.core.scenario): applied by sim run / sim whatif below --config
and
--set, recorded in the output, refused in one line when malformed; the seed traces carry theirs."""

from __future__ import annotations

import importlib.util
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import ConfigError, load_config
from bubblesim.core.runfmt import load_run
from bubblesim.core.scenario import SCENARIO_KEY, config_for_trace, read_scenario
from bubblesim.core.trace import make_trace, write_trace
from sim.__main__ import main as sim_main

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = """# a test scenario
model = "tiny"
batches_in_flight = 1
max_num_seqs = 4

[spec]
method = "ngram-cpu"
k = 2
"""


def trace_file(path: Path, scenario: str | None) -> Path:
    meta = {"description": "scenario test"}
    if scenario is not None:
        meta[SCENARIO_KEY] = scenario
    trace = make_trace(np.linspace(0, 0.5, 6), [40] * 6, [12] * 6, metadata=meta)
    return write_trace(trace, path)


def test_scenario_is_a_layer_below_config_and_set(tmp_path: Path) -> None:
    trace = trace_file(tmp_path / "t.parquet", SCENARIO)
    cfg, sc = config_for_trace(trace, None, [])
    assert sc is not None and sc.flat() == {
        "model": "tiny",
        "batches_in_flight": 1,
        "max_num_seqs": 4,
        "spec.method": "ngram-cpu",
        "spec.k": 2,
    }
    assert (cfg.model, cfg.batches_in_flight, cfg.spec.method, cfg.spec.k) == (
        "tiny",
        1,
        "ngram-cpu",
        2,
    )
    toml = tmp_path / "c.toml"
    toml.write_text("batches_in_flight = 2\n[spec]\nk = 3\n")
    cfg, _ = config_for_trace(trace, toml, ["max_num_seqs=8"])
    assert cfg.batches_in_flight == 2 and cfg.spec.k == 3  # --config over the scenario
    assert cfg.spec.method == "ngram-cpu" and cfg.model == "tiny"  # the rest kept
    assert cfg.max_num_seqs == 8  # --set over both
    cfg, sc = config_for_trace(trace, None, ["model=tiny"], use_scenario=False)
    assert sc is None and cfg == load_config(None, ["model=tiny"])


def test_sim_run_applies_and_records_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = trace_file(tmp_path / "t.parquet", SCENARIO)
    out = tmp_path / "run"
    assert sim_main(["run", str(trace), "-q", "--set", "spec.k=4", "-o", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"scenario of {trace} applied: model=tiny batches_in_flight=1")
    assert "spec.method=ngram-cpu spec.k=2" in printed[0]
    run = load_run(out)
    assert run.summary["scenario"] == {
        "trace": str(trace),
        "keys": {
            "model": "tiny",
            "batches_in_flight": 1,
            "max_num_seqs": 4,
            "spec.method": "ngram-cpu",
            "spec.k": 2,
        },
    }
    c = run.summary["config"]
    assert (c["model"], c["batches_in_flight"], c["spec"]["method"], c["spec"]["k"]) == (
        "tiny",
        1,
        "ngram-cpu",
        4,
    )


def test_a_trace_without_one_is_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = trace_file(tmp_path / "t.parquet", None)
    assert read_scenario(trace) is None
    cfg, sc = config_for_trace(trace, None, ["model=tiny"])
    assert sc is None and cfg == load_config(None, ["model=tiny"])
    out = tmp_path / "run"
    assert sim_main(["run", str(trace), "-q", "--set", "model=tiny", "-o", str(out)]) == 0
    assert "scenario" not in capsys.readouterr().out
    run = load_run(out)
    assert "scenario" not in run.summary
    assert run.summary["config"] == load_config(None, ["model=tiny"]).to_dict()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('model = "tiny"\nbatches_in_flight = [', "is not valid TOML"),
        ('model = "tiny"\nno_such_key = 1\n', "config key 'no_such_key': unknown key"),
        ("batches_in_flight = 7\n", "config key 'batches_in_flight': must be 1, 2 or 3"),
    ],
)
def test_a_malformed_scenario_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, text: str, why: str
) -> None:
    from bubblesim.core.cli import run_main

    trace = trace_file(tmp_path / "t.parquet", text)
    with pytest.raises(ConfigError, match=f"trace '{trace}': scenario '{SCENARIO_KEY}'"):
        read_scenario(trace)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run_main(sim_main, ["run", str(trace), "-q", "-o", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0] and str(trace) in err[0], err
    assert not out.exists()
    # --no-scenario runs it as a plain trace
    assert (
        sim_main(["run", str(trace), "-q", "--no-scenario", "--set", "model=tiny", "-o", str(out)])
        == 0
    )


def test_whatif_applies_and_records_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = trace_file(tmp_path / "t.parquet", SCENARIO)
    out = tmp_path / "w"
    args = ["whatif", str(trace), "--variants", "batches_in_flight=2", "--jobs", "1", "-q"]
    assert sim_main([*args, "--keep-runs", "-o", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"scenario of {trace} applied: model=tiny")
    info = json.loads((out / "whatif-info.json").read_text())
    assert info["scenario"]["spec.method"] == "ngram-cpu"
    assert info["baseline"]["batches_in_flight"] == 1 and info["baseline"]["model"] == "tiny"
    assert info["variants"]["batches_in_flight=2"]["overrides"] == {"batches_in_flight": 2}
    kept = load_run(out / "runs" / "batches_in_flight=2")
    assert kept.has_steps and kept.summary["scenario"]["keys"]["spec.method"] == "ngram-cpu"
    assert kept.summary["config"]["batches_in_flight"] == 2


def _build_module():  # traces/build.py, for its SCENARIOS table
    spec = importlib.util.spec_from_file_location("traces_build", ROOT / "traces" / "build.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seed_traces_carry_their_scenario() -> None:
    scenarios = _build_module().SCENARIOS
    assert sorted(scenarios) == sorted(p.stem for p in (ROOT / "traces").glob("seed*.parquet"))
    for name, toml in scenarios.items():
        sc = read_scenario(ROOT / "traces" / f"{name}.parquet")
        assert sc is not None, name
        assert sc.data == tomllib.loads((ROOT / toml).read_text()), f"{name}: rebuild the trace"
        assert "profile" not in sc.data, f"{name}: a trace cannot carry a profile file"
