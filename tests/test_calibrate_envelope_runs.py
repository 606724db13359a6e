"""`replay calibrate --envelope RUN` (replay/analysis/envelope_runs.py): a run over every batch
size, on a host of another level, gives the CPU phases their shape past the calibration run's
batches; its level is measured over the batches both hold and divided out.

Synthetic runs written with the run recorder: each phase's true time is a known function of the
batch's rows whose per-row cost rises past the calibration's 24 rows (as measured on every H100
lease: reports/fidelity/README.md section N)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.cli import run_main
from bubblesim.core.config import Config
from bubblesim.core.runfmt import RunRecorder, write_run
from bubblesim.core.shape import BatchShape
from replay.__main__ import main
from replay.analysis.calibrate import CalibrationError, calibrate, write_calibration
from replay.analysis.envelope_runs import ENVELOPE_PHASES
from sim.cost import CostModel

TRACE = {"path": "synthetic.parquet", "sha256": "ab" * 32, "rows": 0}
H100 = "NVIDIA H100 80GB HBM3"
# ms at `rows` decode rows: intercept + per row + per row past KNEE (the calibration's largest)
TRUTH = {
    "schedule": (0.02, 0.0008, 0.0008),
    "prepare_inputs": (0.12, 0.003, 0.0005),
    "sample": (0.08, 0.0004, 0.0001),
    "process_outputs": (0.015, 0.0006, 0.0006),
}
KNEE = 24
LAUNCH_MS = 0.03


def truth_ms(phase: str, rows: int | np.ndarray) -> float | np.ndarray:
    a, b, c = TRUTH[phase]
    return a + b * rows + c * np.maximum(0, np.asarray(rows) - KNEE)


DRAFT_MS = 0.004  # process_outputs per draft token, on a speculative-decoding run's steps


def synthetic_run(
    out: Path, rows: np.ndarray, level: float, seed: int, cfg: Config | None = None
) -> Path:
    """A run of decode steps with these row counts on a host `level` x the truth's time (+ 3 %
    noise), with a mixed step of one new request every 10th step; with speculative decoding in
    `cfg`, 3 drafts a row (DRAFT_MS each in process_outputs)."""
    drafts = 3 if cfg is not None and cfg.spec.enabled else 0
    rng = np.random.default_rng(seed)
    rec = RunRecorder()
    rec.add_request("r0", 0.0)
    t = 0.0
    for i, n in enumerate(rows.tolist()):
        mixed = i % 10 == 9
        shape = BatchShape(
            num_reqs=n + mixed,
            num_prefill_reqs=int(mixed),
            prefill_tokens=300 * mixed,
            decode_tokens=n,
            kv_read_tokens=500 * n,
            attn_pairs=0,
            max_kv_tokens=600,
            new_reqs=int(mixed),
            draft_tokens=drafts * n,
        )
        k = rec.add_step(shape)
        for ph in ("schedule", "prepare_inputs", "launch", "sample", "process_outputs"):
            ms = LAUNCH_MS if ph == "launch" else float(truth_ms(ph, n))
            if mixed and ph == "prepare_inputs":
                ms += 0.4  # the new request's inputs
            if ph == "process_outputs":
                ms += DRAFT_MS * drafts * n
            d = level * ms * (1 + 0.03 * rng.standard_normal()) / 1e3
            rec.phase(k, ph, t, t + d)
            if ph == "launch":
                rec.gpu(k, t + d, t + d + 1e-3)
                t += 1e-3
            t += d
        rec.tokens(0, t)
    rec.finish(0, t)
    write_run(out, rec, config=cfg or Config(model="tiny"), trace=TRACE,
              source={"kind": "replay", "gpu": H100})  # fmt: skip
    return out


def calibration_rows(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 25, 1500)


def ramp_rows() -> np.ndarray:
    """Fills to 256 rows at once and drains to one, as the ramp trace does."""
    return np.concatenate([np.full(300, 256), np.arange(255, 0, -1).repeat(3)])


def predicted(profile: dict, phase: str, rows: int) -> float:
    """The simulator's time for the phase on a decode step of `rows` rows."""
    shape = BatchShape(num_reqs=rows, decode_tokens=rows, kv_read_tokens=500 * rows,
                       max_kv_tokens=600)  # fmt: skip
    return CostModel(Config(model="tiny", gpu="h100"), profile).cpu_phase_ms(phase, shape)


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("envelope")
    calib = synthetic_run(tmp / "calib", calibration_rows(), 1.0, 2)
    ramp = synthetic_run(tmp / "ramp", ramp_rows(), 1.5, 3)  # a host 1.5 x slower
    alone = calibrate([calib], spread=False)
    joined = calibrate([calib], spread=False, envelope=[ramp])
    return {"alone": alone, "joined": joined, "calib": calib, "ramp": ramp, "tmp": tmp}


def test_the_level_is_measured_and_divided_out(fits: dict) -> None:
    (note,) = [n for n in fits["joined"].notes if "envelope run" in n]
    level = float(note.split("level ")[1].split()[0])
    assert level == pytest.approx(1.5, rel=0.03)
    prof = fits["joined"].profile
    # the calibration's level stays: at its own batches the phases are as the run alone gave them
    for phase in ENVELOPE_PHASES:
        for rows in (4, 12, 20):
            true = float(truth_ms(phase, rows))
            assert predicted(prof, phase, rows) == pytest.approx(true, rel=0.2), (phase, rows)


def test_the_shape_holds_where_the_calibration_never_went(fits: dict) -> None:
    alone, joined = fits["alone"].profile, fits["joined"].profile
    for phase in ENVELOPE_PHASES:
        for rows in (64, 128, 200):
            true = float(truth_ms(phase, rows))
            assert predicted(joined, phase, rows) == pytest.approx(true, rel=0.1), (phase, rows)
    for phase in ("schedule", "process_outputs"):  # the extrapolation, where the knee is steep
        assert predicted(alone, phase, 200) < 0.6 * float(truth_ms(phase, 200))


def test_only_the_envelope_phases_change(fits: dict) -> None:
    alone, joined = fits["alone"].profile, fits["joined"].profile
    assert joined["launch"] == alone["launch"]
    assert joined["cpu_phases"]["launch"] == alone["cpu_phases"]["launch"]
    assert joined["source_runs"] == alone["source_runs"] == [str(fits["calib"])]
    assert joined["envelope_runs"] == [str(fits["ramp"])]
    assert "envelope_runs" not in alone


def test_the_mixed_steps_of_the_envelope_run_do_not_join(fits: dict) -> None:
    # every 10th step of both runs adds 0.4 ms of prepare_inputs for its one new request; the
    # ramp's would come in at 1.5 x if its mixed steps joined
    m = fits["joined"].profile["cpu_phases"]["prepare_inputs"]
    new_request_ms = m.get("new_reqs", 0.0) + 300 * m.get("num_tokens", 0.0)
    assert new_request_ms == pytest.approx(0.4, rel=0.1)


def test_spec_decoding_steps_keep_the_calibration_fit(fits: dict) -> None:
    # a speculative-decoding calibration run beside the plain one: the refit reads plain steps
    # only, and the field only spec steps hold keeps its first fit
    cfg = Config(model="tiny").replace(**{"spec.method": "ngram-gpu"})
    spec = synthetic_run(fits["tmp"] / "calib-spec", calibration_rows(7), 1.0, 8, cfg)
    alone = calibrate([fits["calib"], spec], spread=False).profile["cpu_phases"]
    joined = calibrate([fits["calib"], spec], spread=False, envelope=[fits["ramp"]]).profile
    po = joined["cpu_phases"]["process_outputs"]
    assert po["draft_tokens"] == alone["process_outputs"]["draft_tokens"]
    assert po["draft_tokens"] == pytest.approx(DRAFT_MS, rel=0.1)
    true = float(truth_ms("process_outputs", 200))
    assert predicted(joined, "process_outputs", 200) == pytest.approx(true, rel=0.1)


def test_the_profile_is_written_and_read_back(fits: dict) -> None:
    out = fits["tmp"] / "profile.json"
    write_calibration(fits["joined"], out, {})
    data = json.loads(out.read_text())
    assert data["envelope_runs"] == [str(fits["ramp"])]


def test_an_envelope_run_with_spec_decoding_is_refused(fits: dict) -> None:
    cfg = Config(model="tiny").replace(**{"spec.method": "ngram-gpu"})
    spec = synthetic_run(fits["tmp"] / "spec", ramp_rows(), 1.0, 4, cfg)
    with pytest.raises(CalibrationError, match="speculative decoding"):
        calibrate([fits["calib"]], spread=False, envelope=[spec])


def test_an_envelope_run_of_another_model_is_refused(fits: dict) -> None:
    other = synthetic_run(fits["tmp"] / "other", ramp_rows(), 1.0, 5, Config(model="llama3.2-1b"))
    with pytest.raises(CalibrationError, match="the phases' shape is per model"):
        calibrate([fits["calib"]], spread=False, envelope=[other])


def test_an_envelope_run_that_never_drains_is_refused(fits: dict) -> None:
    full = synthetic_run(fits["tmp"] / "full", np.full(400, 256), 1.0, 6)
    with pytest.raises(CalibrationError, match="must drain to small batches"):
        calibrate([fits["calib"]], spread=False, envelope=[full])


def test_the_command_takes_envelope_runs(fits: dict, capsys: pytest.CaptureFixture[str]) -> None:
    prof = fits["tmp"] / "cli-profile.json"
    args = ["calibrate", str(fits["calib"]), "--no-spread", "-o", str(prof)]
    assert run_main(main, [*args, "--envelope", str(fits["ramp"])]) == 0
    assert json.loads(prof.read_text())["envelope_runs"] == [str(fits["ramp"])]
    assert "envelope run" in capsys.readouterr().out
    spec = fits["tmp"] / "spec"  # made by the spec test, or here
    if not spec.exists():
        cfg = Config(model="tiny").replace(**{"spec.method": "ngram-gpu"})
        synthetic_run(spec, ramp_rows(), 1.0, 4, cfg)
    bad = fits["tmp"] / "bad-profile.json"
    with pytest.raises(SystemExit) as e:
        run_main(main, ["calibrate", str(fits["calib"]), "-o", str(bad), "--envelope", str(spec)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "speculative decoding" in err
    assert not bad.exists()
