"""Envelope runs: measured runs that give the CPU phases their shape over batch sizes the
calibration runs never reach, levelled to the calibration's host (`replay calibrate
--envelope RUN`).

A calibration run of realistic traffic (traces/fidelity/azure45x4) keeps its decode batches
below ~32 rows. Fitted there, a phase's per-row cost is extrapolated to 64-256 rows, where
schedule and process_outputs were measured 2-3x the fit and prepare_inputs and sample ~0.4-0.6x,
the same on every lease (reports/fidelity/README.md section N). An envelope run (the ramp of
traces/fidelity/ramp.parquet: the batch fills to max_num_seqs and drains) holds every batch
size, but it is measured at another time, often on another lease, at another host level.

So an envelope run gives shape, not level: its phase times are divided by its level, the ratio
of its measured CPU time to the calibration runs' fit over its steps inside the calibration's
range of rows (`OVERLAP_FIELD` up to the calibration runs' largest), and then join the phase fits.
Only its decode steps join: its mixed steps (a queue of requests prefilled in 8k-token chunks of
~25 prompts at its start) are unlike traffic's, whose one or two new requests a step the
calibration runs hold; least squares would give their few steps the new-request terms. Its
launches, GC, intake, host speed and GPU intervals join no fit.

The refit reads the plain steps: the calibration runs' steps without speculative decoding, and the
envelope runs'. The speculative-decoding runs share the phases' base models, but their phases
cost otherwise per row (they schedule, verify and process k + 1 tokens a row, at batches the
calibration runs hold), so fields only they hold (draft_tokens) and their seed terms keep the
calibration's fit.

The refit weighs each step by the inverse of its time under the calibration runs' fit (least
squares on relative errors): unweighted, a ramp's thousand steps at 200-256 rows would outweigh
the small batches where most traffic runs and trade their accuracy (the intercept) for the
large ones'.

Invariant: the envelope runs run the calibration run's engine and model (the same active seed
terms as the first calibration run, no speculative decoding), so a phase's base model means
the same work on both sides. They may come from another GPU: only host phases are read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from bubblesim.core.runfmt import Run
from replay.analysis.steps import CalibrationError, Steps, eval_linear, run_config
from sim.cost.terms import TERM_NAMES, active_terms, term_target

# the phases an envelope run's steps join (launch is the graph/eager launch law, fitted on
# the calibration runs alone; draft needs speculative decoding)
ENVELOPE_PHASES = ("schedule", "prepare_inputs", "sample", "process_outputs")
OVERLAP_FIELD = "num_reqs"
MIN_OVERLAP_STEPS = 50
MIN_WEIGHT_MS = 1e-3


@dataclass(frozen=True)
class Level:
    """One envelope run's host level against the calibration runs' fit."""

    path: str
    level: float  # measured / fitted CPU time over the overlap steps (the phases summed)
    overlap_steps: int
    max_rows: int  # the overlap: steps with OVERLAP_FIELD <= this (the calibration's largest)
    steps: int  # the run's decode steps with every envelope phase measured: those that join

    def describe(self) -> str:
        return (
            f"{self.path}: level {self.level:.3f} (measured / fitted CPU time over "
            f"{self.overlap_steps} decode steps of <= {self.max_rows} rows), its {self.steps} "
            "decode steps divided by it"
        )


def check_envelope_runs(calibration: Sequence[Run], envelope: Sequence[Run]) -> None:
    """CalibrationError naming the run unless each envelope run runs the first calibration
    run's engine (module docstring's invariant)."""
    first = run_config(calibration[0])
    want = set(active_terms(first))
    for run in envelope:
        cfg = run_config(run)
        if (cfg.model, cfg.dtype) != (first.model, first.dtype):
            raise CalibrationError(
                f"envelope run '{run.path}' is of {cfg.model}/{cfg.dtype}, the calibration runs "
                f"of {first.model}/{first.dtype}: the phases' shape is per model"
            )
        if cfg.spec.enabled:
            raise CalibrationError(
                f"envelope run '{run.path}' uses speculative decoding: an envelope run gives the "
                "plain step's phases their shape (run traces/fidelity/ramp.parquet without spec)"
            )
        got = set(active_terms(cfg))
        if got != want:
            raise CalibrationError(
                f"envelope run '{run.path}' runs other seed switches than the calibration run "
                f"'{calibration[0].path}': {sorted(got ^ want)} differ; run it with the "
                "calibration's engine config"
            )


def fixed_terms_ms(
    steps: Steps,
    phase: str,
    rows: np.ndarray,
    fitted: Mapping[str, Any],
    defaults: Mapping[str, Mapping[str, float]],
) -> np.ndarray:
    """The seed terms of `phase` a fit held at their defaults (active, not fitted), on `rows`:
    what `fit_target` subtracted before fitting the base model."""
    out = np.zeros(int(rows.sum()))
    for t in TERM_NAMES:
        if term_target(t) != phase or t in fitted or t not in steps.active:
            continue
        on = steps.active[t][rows]
        if on.any():
            out += np.where(on, eval_linear(defaults[t], steps.cols, rows), 0.0)
    return out


def measure_levels(
    calib: Steps,
    env: Steps,
    env_runs: Sequence[Run],
    models: Mapping[str, Mapping[str, float]],
    fitted_terms: Mapping[str, Any],
    defaults: Mapping[str, Mapping[str, float]],
) -> list[Level]:
    """Each envelope run's level: its measured phase time over the fit's (`models`, the
    calibration runs' phase models) on its steps within the calibration's rows."""
    max_rows = int(calib.cols[OVERLAP_FIELD].max())
    out = []
    for i, run in enumerate(env_runs):
        ok = (env.run == i) & decode_steps(env)
        for p in ENVELOPE_PHASES:
            ok &= np.isfinite(env.phase_ms[p])
        inside = ok & (env.cols[OVERLAP_FIELD] <= max_rows)
        n = int(inside.sum())
        if n < MIN_OVERLAP_STEPS:
            raise CalibrationError(
                f"envelope run '{run.path}' has {n} steps within the calibration runs' "
                f"{max_rows} rows (at least {MIN_OVERLAP_STEPS} are needed to level it to "
                "their host); an envelope run must drain to small batches as the ramp does"
            )
        measured = fitted_ms = 0.0
        for p in ENVELOPE_PHASES:
            if p not in models:
                continue
            y = env.phase_ms[p][inside] - fixed_terms_ms(env, p, inside, fitted_terms, defaults)
            measured += float(y.sum())
            fitted_ms += float(eval_linear(models[p], env.cols, inside).sum())
        if not fitted_ms > 0.0:
            raise CalibrationError(f"envelope run '{run.path}': the fit predicts no CPU time")
        out.append(Level(str(run.path), measured / fitted_ms, n, max_rows, int(ok.sum())))
    return out


def decode_steps(steps: Steps) -> np.ndarray:
    """The steps that prefill nothing (module docstring: an envelope run's steps that join)."""
    return steps.cols["num_prefill_reqs"] == 0


def levelled(env: Steps, levels: Sequence[Level]) -> Steps:
    """`env` with each run's phase times divided by its level, absent (NaN) outside the envelope
    phases and on mixed steps; the other columns as they are."""
    scale = np.array([lv.level for lv in levels])[env.run]
    joins = decode_steps(env)
    phase_ms = {
        p: (np.where(joins, v / scale, np.nan) if p in ENVELOPE_PHASES else np.full_like(v, np.nan))
        for p, v in env.phase_ms.items()
    }
    return replace(env, phase_ms=phase_ms, clean=np.zeros(len(env), bool))  # no GPU fit reads them


def relative_weights(steps: Steps, model: Mapping[str, float], rows: np.ndarray) -> np.ndarray:
    """1 / the model's time on each step (floored at 1 us): least squares on relative errors."""
    out = np.ones(len(steps))
    out[rows] = 1.0 / np.maximum(eval_linear(model, steps.cols, rows), MIN_WEIGHT_MS)
    return out


def weighted(steps: Steps, w: np.ndarray) -> Steps:
    """`steps` with every shape column and phase time multiplied by `w`: a linear fit to them is
    the weighted fit to `steps` (the coefficients mean the same)."""
    return replace(
        steps,
        cols={k: v * w for k, v in steps.cols.items()},
        phase_ms={p: v * w for p, v in steps.phase_ms.items()},
    )


def joined(calib: Steps, env: Steps, num_calib_runs: int) -> Steps:
    """The calibration steps followed by the (levelled) envelope steps; run indices of the
    envelope steps follow the calibration runs'. Both carry the same derived columns and terms."""
    cols = {k: np.concatenate([calib.cols[k], env.cols[k]]) for k in calib.cols}
    phase_ms = {p: np.concatenate([calib.phase_ms[p], env.phase_ms[p]]) for p in calib.phase_ms}
    active = {t: np.concatenate([calib.active[t], env.active[t]]) for t in calib.active}
    return Steps(
        cols=cols,
        phase_ms=phase_ms,
        gpu_ms=np.concatenate([calib.gpu_ms, env.gpu_ms]),
        clean=np.concatenate([calib.clean, env.clean]),
        graph=np.concatenate([calib.graph, env.graph]),
        run=np.concatenate([calib.run, env.run + num_calib_runs]),
        active=active,
    )
