"""The host probe (replay.gpu.probe, replay.analysis.probe): a fixed small workload served before
every measured run, written as DIR/probe/; its level against a profile; calibrate records the
calibration host's (`host_probe`); host_scale = a target probe's level over it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from bubblesim.core.config import Config  # noqa: E402
from bubblesim.core.runfmt import load_run  # noqa: E402
from bubblesim.core.trace import make_trace, write_trace  # noqa: E402
from replay.analysis.calibrate import calibrate  # noqa: E402
from replay.analysis.probe import (  # noqa: E402
    PROBE_TRACE,
    ProbeError,
    host_scale,
    probe_level,
    probe_run,
)
from replay.gpu.probe import PROBE_REQUESTS, PROBE_REQUESTS_CPU, probe_inputs  # noqa: E402
from replay.gpu.run import replay  # noqa: E402
from sim.cost.profile import ProfileError, resolve_profile, validate_profile  # noqa: E402

CPU_TINY = Config(model="tiny", device="cpu", max_num_batched_tokens=64, max_model_len=512)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("probe")
    t = make_trace([0.0, 0.003, 0.006, 0.02], [30, 12, 70, 20], [6, 9, 4, 7])
    trace = write_trace(t, d / "few.parquet")
    return {
        "a": replay(CPU_TINY, trace, d / "a").out,
        "b": replay(CPU_TINY, trace, d / "b").out,
        "none": replay(CPU_TINY, trace, d / "none", probe=False).out,
    }


def test_probe_inputs_are_fixed_and_fit_the_config() -> None:
    gpu = probe_inputs(4096, 8192, "cuda")
    assert len(gpu) == PROBE_REQUESTS and gpu == probe_inputs(4096, 8192, "cuda")
    assert max(r.prompt_len for r in gpu) == 2048
    assert [r.arrival_s for r in gpu] == sorted(r.arrival_s for r in gpu)
    small = probe_inputs(40, 16, "cuda")  # a short context and a small token budget
    assert all(1 <= r.prompt_len <= 16 and r.prompt_len + r.output_len <= 40 for r in small)
    cpu = probe_inputs(4096, 8192, "cpu")
    assert len(cpu) == PROBE_REQUESTS_CPU and max(r.prompt_len for r in cpu) <= 128


def test_a_run_carries_its_probe(runs: dict[str, Path]) -> None:
    main = load_run(runs["a"])
    probe = probe_run(runs["a"])
    assert probe.path == runs["a"] / "probe" and probe.complete
    assert probe.summary["trace"]["path"] == PROBE_TRACE
    assert probe.summary["num_finished"] == PROBE_REQUESTS_CPU
    assert main.summary["replay"]["host_probe"]["steps"] == probe.summary["num_steps"] > 0
    assert main.summary["num_finished"] == 4  # the probe's requests are not the run's
    assert probe_run(probe.path).path == probe.path  # a probe folder names itself
    assert not (runs["none"] / "probe").exists()
    assert "host_probe" not in load_run(runs["none"]).summary["replay"]


def test_calibrate_records_the_level_and_its_own_scale_is_one(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    cal = calibrate([runs["a"]])
    prof = validate_profile(cal.profile)
    level = prof["host_probe"]["level"]
    assert prof["host_probe"]["runs"] == 1 and level > 0
    assert level == pytest.approx(probe_level(runs["a"], resolve_profile(prof)))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    assert host_scale(runs["a"], path) == pytest.approx(1.0)
    other = host_scale(runs["b"], path)  # the same host a moment later: near 1, not exactly
    assert np.isfinite(other) and 0.2 < other < 5
    assert "host_probe" not in calibrate([runs["none"]]).profile


def test_missing_probes_get_one_clear_error(runs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="no host probe"):
        probe_run(runs["none"])
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(calibrate([runs["none"]]).profile))
    with pytest.raises(ProbeError, match="host_probe"):
        host_scale(runs["a"], bare)


@pytest.mark.parametrize(
    ("value", "why"),
    [({"level": 0.0, "runs": 1}, "must be > 0"), ({"level": 1.0, "x": 1}, "unknown key"),
     ({"level": "1"}, "finite number")],
)  # fmt: skip
def test_bad_host_probe_keys_are_refused(value: dict, why: str) -> None:
    with pytest.raises(ProfileError, match=why):
        validate_profile({"version": resolve_profile(None)["version"], "host_probe": value})
