"""How much a run's host speed wanders, measured or predicted (section K).

    python reports/fidelity/host_episodes.py PROFILE RUN [RUN ...] [--predicted WORK]

Per run folder (a measured run or a simulated one, read alike): its steps' log speed, log(the
measured CPU phases' ms / what PROFILE predicts for the step's shape: replay.analysis.hostspeed),
its level (exp of the mean: the run's host against the profile's) and the standard deviation of
the log speed's means over bins of 0.05, 0.25 and 1 s of the run's time. The 1 s figure is the
slow wander that moves a request's TPOT: a prediction draws it from the profile's `host_speed`
process (its calibration runs' host), a measured run shows its own host's, beside it. The bins
also hold the steps' mix (a bin with an eager step reads its misfit), so compare a run with its
own prediction, not runs of different workloads. `--predicted WORK`: beside each measured RUN,
the 1 s figure of its predictions that `host_level.py --eager-own --seeds N --work WORK` left
(`sim-<run>-host-eager`, `-s1` ...): their mean [min, max].
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.hostspeed import binned, step_log_speeds  # noqa: E402
from replay.analysis.steps import load_steps  # noqa: E402
from sim.cost.profile import load_profile, resolve_profile  # noqa: E402

BINS_S = (0.05, 0.25, 1.0)


def wander(profile: dict, path: Path) -> tuple[float, list[float]]:
    """(the run's level, the sd of its log speed's bin means at each of BINS_S)."""
    run = load_run(path)
    series = step_log_speeds(profile, [run], load_steps([run]))[0]
    sds = []
    for bin_s in BINS_S:
        means, _ = binned(series, bin_s)
        ok = np.isfinite(means)
        sds.append(float(np.std(means[ok])) if ok.sum() > 1 else float("nan"))
    return float(np.exp(np.mean(series.log_speed))), sds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--predicted", type=Path, help="host_level.py's --work folder (module doc)")
    args = ap.parse_args()
    profile = resolve_profile(load_profile(args.profile))
    for path in args.runs:
        level, sds = wander(profile, path)
        cells = "  ".join(f"sd {b:g} s {sd:.3f}" for b, sd in zip(BINS_S, sds, strict=True))
        line = f"{path.parent.name}/{path.name}: level x{level:.2f}  {cells}"
        if args.predicted is not None:
            line += f"  | predicted sd 1 s {predicted(profile, args.predicted, path.name)}"
        print(line)


def predicted(profile: dict, work: Path, run: str) -> str:
    """The 1 s figure of a run's seeded predictions in `work`: mean [min, max] (n)."""
    base = work / f"sim-{run}-host-eager"
    paths = [base] + [Path(p) for p in sorted(glob.glob(f"{base}-s[0-9]*"))]
    sds = [wander(profile, p)[1][-1] for p in paths if p.is_dir()]
    if not sds:
        return "- (none)"
    return f"{np.mean(sds):.3f} [{min(sds):.3f}, {max(sds):.3f}] ({len(sds)})"


if __name__ == "__main__":
    main()
