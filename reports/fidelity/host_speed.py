"""The host speed's evidence on the measured runs (docs/cost-model.md, "Host speed"): per run,
the steps' log(measured / predicted host time) in 50 ms bins, its sd and the bins'
autocorrelation by lag, and which phases share the speed (per phase, in 0.1 s bins of >= 10
steps: the slope and R^2 of its log(measured / predicted) on the other phases' together), with
a committed profile (nothing is fitted here; `replay calibrate` fits `host_speed` on the
calibration runs alone; the checks are shown for judgement only):

    python reports/fidelity/host_speed.py --prefix 8b- \
        --profile reports/fidelity/gen/profile-h100-llama3-8b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.phases import CPU_PHASES  # noqa: E402
from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.hostspeed import binned, run_report, step_log_speeds  # noqa: E402
from replay.analysis.quality import phase_predicted_ms  # noqa: E402
from replay.analysis.steps import Steps, load_steps  # noqa: E402
from sim.cost import resolve_profile  # noqa: E402

LOADING_BIN_S = 0.1
LOADING_MIN_STEPS = 10


def phase_loadings(prof: dict, run, steps: Steps) -> str:  # noqa: ANN001
    """Per phase with a prediction at >= 1000 steps: slope and R^2 of its bins' log(measured /
    predicted) on the other phases' (their sums), each less its mean."""
    t = run.arrays("steps")["schedule_start_s"]
    b = ((t - t[0]) // LOADING_BIN_S).astype(np.int64)
    n = int(b.max()) + 1
    meas, pred = {}, {}
    for phase in CPU_PHASES:
        y = steps.phase_ms[phase]
        rows = np.isfinite(y)
        if rows.sum() < 1000:
            continue
        p = np.zeros(len(y))
        p[rows] = phase_predicted_ms(prof, [run], steps, phase, rows)
        meas[phase] = np.bincount(b, np.where(rows, y, 0.0), n)
        pred[phase] = np.bincount(b, p, n)
    ok = np.bincount(b, minlength=n) >= LOADING_MIN_STEPS
    for phase in meas:
        ok &= (meas[phase] > 0) & (pred[phase] > 0)
    out = []
    for phase in meas:
        rest = [q for q in meas if q != phase]
        if not rest or ok.sum() < 20:
            continue
        x = np.log(sum(meas[q][ok] for q in rest) / sum(pred[q][ok] for q in rest))
        y = np.log(meas[phase][ok] / pred[phase][ok])
        x, y = x - x.mean(), y - y.mean()
        slope, r2 = float((x * y).sum() / (x * x).sum()), float(np.corrcoef(x, y)[0, 1] ** 2)
        out.append(f"{phase} {slope:.2f} (R2 {r2:.2f})")
    return ", ".join(out) + f" over {int(ok.sum())} bins"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=ROOT / "reports/fidelity/gen/runs")
    ap.add_argument("--prefix", default="1b-", help="runs of one model (the profile's): 1b-, 8b-")
    ap.add_argument(
        "--profile", type=Path, default=ROOT / "reports/fidelity/gen/profile-h100-llama3.2-1b.json"
    )
    args = ap.parse_args()
    prof = resolve_profile(json.loads(args.profile.read_text()))
    hs = prof.get("host_speed")
    if hs:
        print(f"profile host_speed: sigma {hs['sigma']} tau_s {hs['tau_s']}")
    print("run | role | steps | bins | sd per step | sd per bin | autocorrelation at lag (s)")
    for path in sorted(p for p in args.runs.iterdir() if (p / "summary.json").is_file()):
        if not path.name.startswith(args.prefix):
            continue
        run = load_run(path)
        steps = load_steps([run])
        (series,) = step_log_speeds(prof, [run], steps)
        rep = run_report(series, binned(series)[0])
        role = "calibration" if "-calib" in path.name else "check"
        acf = " ".join(
            f"{lag}:{r:+.2f}" if r is not None else f"{lag}:-" for lag, r in rep["acf"].items()
        )
        print(
            f"{path.name} | {role} | {rep['steps']} | {rep['bins']} | {rep['step_sd']:.3f} | "
            f"{rep['bin_sd']:.3f} | {acf}"
        )
        print(f"  phases on the others' speed, slope (R2): {phase_loadings(prof, run, steps)}")


if __name__ == "__main__":
    main()
