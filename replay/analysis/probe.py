"""A host's level from its probe (replay.gpu.probe), and the `host_scale` that carries a
profile to that host.

The level of a set of steps against a profile is their measured CPU phase time over what the
profile predicts for the same steps (every phase, the launch's issue cost included), summed.
A profile made on a host whose calibration runs' probes sat at level L_cal, predicting a run
whose probe sat at L, takes `host_scale = L / L_cal` (sim: every CPU phase's time x it). The
probe is served before the run it scales, so this reads nothing of the run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.runfmt import Run, load_run
from sim.cost.profile import PROBE_KEY, load_profile, resolve_profile

from .quality import phase_predicted_ms
from .steps import load_steps

PROBE_DIR = "probe"  # the probe's run folder inside a measured run's folder
PROBE_TRACE = "(host probe: replay.gpu.probe)"  # a probe folder's summary `trace.path`


class ProbeError(ValueError):
    """A run without a probe, or a profile without the calibration host's probe level."""


def host_level(run: Run, prof: Mapping[str, Any]) -> float:
    """Measured over predicted CPU phase time summed over the run's steps (`prof` resolved)."""
    steps = load_steps([run])
    meas = pred = 0.0
    for phase in CPU_PHASES:
        y = steps.phase_ms[phase]
        rows = np.flatnonzero(np.isfinite(y))
        if rows.size:
            meas += float(y[rows].sum())
            pred += float(phase_predicted_ms(prof, [run], steps, phase, rows).sum())
    if pred <= 0:
        raise ProbeError(f"{run.path}: the profile predicts no CPU time for these steps")
    return meas / pred


def probe_run(run_dir: str | Path) -> Run:
    """The probe folder of a measured run (or a probe folder itself: `python -m replay probe`)."""
    p = Path(run_dir)
    for cand in (p / PROBE_DIR, p):
        try:
            summary = json.loads((cand / "summary.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(summary, dict) and summary.get("trace", {}).get("path") == PROBE_TRACE:
            return load_run(cand)
    raise ProbeError(f"{p}: no host probe ('{PROBE_DIR}/' folder; runs measured before the "
                     "probe existed have none)")  # fmt: skip


def probe_level(run_dir: str | Path, prof: Mapping[str, Any]) -> float:
    """The level of a run's probe against a resolved profile."""
    return host_level(probe_run(run_dir), prof)


def calibration_level(runs: Sequence[Run], prof: Mapping[str, Any]) -> dict[str, Any] | None:
    """The profile key `host_probe` of calibration runs: the mean level of their probes against
    the profile fitted on them (None when none has a probe)."""
    levels = []
    for r in runs:
        try:
            levels.append(probe_level(r.path, prof))
        except ProbeError:
            continue
    if not levels:
        return None
    return {"level": float(np.mean(levels)), "runs": len(levels)}


def host_scale(run_dir: str | Path, profile: str | Path) -> float:
    """`host_scale` for predicting on the host (and minute) of `run_dir`'s probe."""
    raw = load_profile(profile)
    cal = raw.get(PROBE_KEY)
    if cal is None:
        raise ProbeError(f"{profile}: no '{PROBE_KEY}' (its calibration runs had no probe)")
    return probe_level(run_dir, resolve_profile(raw)) / float(cal["level"])
