"""Attribution, not prediction: how much of a check's miss is its host's level.

For each measured check, the host's level against the profile's is the ratio of the measured
CPU phases' total time to what the profile predicts for the same steps (the run's own batch
shapes, every phase, launch included: replay.analysis.quality.phase_predicted_ms); the check is
then predicted again with `--set host_scale=<level>` and judged on the same targets. This
READS the measured run, so its table is no prediction: it says which misses a known host level
would remove (the rest are the model's).

    python reports/fidelity/host_level.py PROFILE RUNS_DIR --gpu h100 --prefix 1b- [--tag T]

With --eager-own the eager (prefill/mixed) launch is taken at its own measured level as well:
after the prediction at the host's level, the run is predicted again from a profile copy whose
`launch.eager_ms` is x (measured / predicted median eager launch), so that the eager launch's
median is the run's own (the median, not the mean: a few eager launches that wait behind long
prefills make a run's mean). What then still misses is neither the host's level nor the eager
launch's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checks import TARGETS, add_run_args, cell, measured_runs, predict_and_compare  # noqa: E402


def host_level(run_dir: Path, profile: Path) -> float:
    """Measured over predicted CPU phase time summed over the run's own steps."""
    from bubblesim.core.runfmt import load_run
    from replay.analysis.probe import host_level as level
    from sim.cost.profile import load_profile, resolve_profile

    return level(load_run(run_dir), resolve_profile(load_profile(profile)))


def eager_launch_p50(run_dir: Path) -> float | None:
    """Median launch ms over a run's eager (not graphed) steps; None when it has none."""
    from bubblesim.core.phases import LAUNCH
    from bubblesim.core.runfmt import load_run
    from replay.analysis.steps import load_steps

    steps = load_steps([load_run(run_dir)])
    y = steps.phase_ms[LAUNCH][~steps.graph]
    y = y[np.isfinite(y)]
    return float(np.median(y)) if y.size else None


def eager_own_profile(profile: Path, factor: float, out: Path) -> Path:
    """A copy of `profile` whose eager launch base is x `factor` (the run's own eager level)."""
    data = json.loads(profile.read_text())
    data["launch"]["eager_ms"] = float(data["launch"]["eager_ms"]) * factor
    out.write_text(json.dumps(data, indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument(
        "--eager-own", action="store_true",
        help="also take the eager launch at the run's own measured level (an attribution)",
    )  # fmt: skip
    ap.add_argument(
        "--with-calib", action="store_true",
        help="also the runs named *-calib* (left out by default: a profile's own runs)",
    )  # fmt: skip
    args = ap.parse_args()
    sfx = f"-{args.tag}" if args.tag else ""
    args.work.mkdir(parents=True, exist_ok=True)
    eager_col = " eager launch p50, measured / predicted |" if args.eager_own else ""
    head = f"| run | host level |{eager_col} " + " | ".join(c for _, c, _ in TARGETS) + " |"
    rows = [head, "|---" * (len(TARGETS) + 2 + args.eager_own) + "|"]
    for meas, summary in measured_runs(args.runs, args.prefix):
        if "-calib" in meas.name and not args.with_calib:
            continue
        level = host_level(meas, args.profile)
        name = f"{meas.name}{sfx}-host"
        at_level = (f"host_scale={level:.4f}",)
        data = predict_and_compare(
            meas, summary, args.profile, args.gpu, args.work, name, extra_sets=at_level
        )
        eager = ""
        if args.eager_own:
            meas_p50 = eager_launch_p50(meas)
            pred_p50 = eager_launch_p50(args.work / f"sim-{name}")
            eager = " - |"
            if meas_p50 is not None and pred_p50:
                factor = meas_p50 / pred_p50
                eager = f" x{factor:.2f} |"
                own = eager_own_profile(args.profile, factor, args.work / f"{name}-eager.json")
                data = predict_and_compare(
                    meas, summary, own, args.gpu, args.work, f"{name}-eager", extra_sets=at_level
                )
        cells = [cell(data, k, t) for k, _, t in TARGETS]
        rows.append(f"| {meas.name} | x{level:.2f} |{eager} " + " | ".join(cells) + " |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
