"""The host probe against the runs it preceded (reports/fidelity/README.md section A): per run,
its probe's level against the profile (replay.analysis.probe), the host_scale that gives, and
the run's own level (measured / predicted CPU time over the run's steps, which no prediction
reads); the rms log error of the run's level with the probe's scale and without (scale 1, both
against the calibration run's own level); the median eager launch of the mixed steps in the run
and in its probe; and, per CPU phase, the measured and predicted seconds of mixed and decode
steps.

    python reports/fidelity/probe_levels.py reports/fidelity/gen/profile-h100-llama3.2-1b.json \
        RUNS --prefix 1b-

The section's runs (the 1b fresh set of 22:52-22:59 UTC, with probes) are not in the tree:
`git restore --source=efeaa3a -- reports/fidelity/gen/runsA` puts them back (7 MB), in
reports/fidelity/gen/runsA/ (the calibration runs there are copies of gen/runs/1b-calib*).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.phases import CPU_PHASES, LAUNCH  # noqa: E402
from bubblesim.core.runfmt import Run, load_run  # noqa: E402
from replay.analysis.probe import PROBE_KEY, host_level, probe_run  # noqa: E402
from replay.analysis.quality import phase_predicted_ms  # noqa: E402
from replay.analysis.steps import load_steps  # noqa: E402
from sim.cost.profile import load_profile, resolve_profile  # noqa: E402


def mixed_launch_ms(run: Run) -> float:
    """Median eager launch (ms) of the run's steps with a prefill."""
    st = load_steps([run])
    y = st.phase_ms[LAUNCH]
    m = (st.cols["prefill_tokens"] > 0) & ~st.graph & np.isfinite(y)
    return float(np.median(y[m])) if m.any() else float("nan")


def phase_seconds(run: Run, prof: dict) -> str:
    """measured/predicted seconds per CPU phase, mixed and decode steps."""
    st = load_steps([run])
    mixed = st.cols["prefill_tokens"] > 0
    out = []
    for phase in CPU_PHASES:
        y = st.phase_ms[phase]
        for tag, m in (("mix", mixed), ("dec", ~mixed)):
            rows = np.flatnonzero(np.isfinite(y) & m)
            if rows.size:
                pred = phase_predicted_ms(prof, [run], st, phase, rows).sum() / 1e3
                out.append(f"{phase}-{tag} {y[rows].sum() / 1e3:.2f}/{pred:.2f}")
    return ", ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", type=Path)
    ap.add_argument("--prefix", default="")
    args = ap.parse_args()
    raw = load_profile(args.profile)
    prof = resolve_profile(raw)
    cal_probe = float(raw[PROBE_KEY]["level"])
    dirs = sorted(p for p in args.runs.iterdir() if p.name.startswith(args.prefix))
    rows = []
    print("run | probe level | host_scale | run's level | mixed launch p50 ms: run, probe")
    for d in dirs:
        run = load_run(d)
        probe = probe_run(d)
        pl, rl = host_level(probe, prof), host_level(run, prof)
        rows.append((d.name, pl / cal_probe, rl))
        print(f"{d.name} | {pl:.3f} | {pl / cal_probe:.3f} | {rl:.3f} | "
              f"{mixed_launch_ms(run):.2f}, {mixed_launch_ms(probe):.2f}")  # fmt: skip
    cal = [r for r in rows if r[0].endswith("-calib")]
    checks = [r for r in rows if "-calib" not in r[0]]
    if cal and checks:
        base = cal[0][2]  # the calibration run's own level: the profile's host
        none = np.array([np.log(r[2] / base) for r in checks])
        with_probe = np.array([np.log(r[2] / (base * r[1])) for r in checks])
        corr = np.corrcoef([np.log(r[1]) for r in checks], [np.log(r[2]) for r in checks])[0, 1]
        print(f"checks' level, rms log error: scale 1 {np.sqrt((none**2).mean()):.3f}, the "
              f"probe's scale {np.sqrt((with_probe**2).mean()):.3f}; log probe scale vs log run "
              f"level: correlation {corr:.2f}")  # fmt: skip
    launches = [(mixed_launch_ms(load_run(d)), mixed_launch_ms(probe_run(d))) for d in dirs]
    lr, lp = np.log(np.array(launches)).T
    print(f"mixed launch p50 over the runs {np.exp(lr).min():.1f}-{np.exp(lr).max():.1f} ms; "
          f"log run vs log probe: correlation {np.corrcoef(lr, lp)[0, 1]:.2f}")  # fmt: skip
    print("CPU seconds, measured/predicted:")
    for d in dirs:
        print(f"  {d.name}: {phase_seconds(load_run(d), prof)}")


if __name__ == "__main__":
    main()
