"""Attribution, not prediction: how much of a check's miss is its host's level.

For each measured check, the host's level against the profile's is the ratio of the measured
CPU phases' total time to what the profile predicts for the same steps (the run's own batch
shapes, every phase, launch included: replay.analysis.quality.phase_predicted_ms); the check is
then predicted again with `--set host_scale=<level>` and judged on the same targets. This
READS the measured run, so its table is no prediction: it says which misses a known host level
would remove (the rest are the model's).

    python reports/fidelity/host_level.py PROFILE RUNS_DIR --gpu h100 --prefix 1b- [--tag T]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checks import TARGETS, add_run_args, cell, measured_runs, predict_and_compare  # noqa: E402


def host_level(run_dir: Path, profile: Path) -> float:
    """Measured over predicted CPU phase time summed over the run's own steps."""
    from bubblesim.core.runfmt import load_run
    from replay.analysis.probe import host_level as level
    from sim.cost.profile import load_profile, resolve_profile

    return level(load_run(run_dir), resolve_profile(load_profile(profile)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    args = ap.parse_args()
    sfx = f"-{args.tag}" if args.tag else ""
    args.work.mkdir(parents=True, exist_ok=True)
    head = "| run | host level | " + " | ".join(c for _, c, _ in TARGETS) + " |"
    rows = [head, "|---" * (len(TARGETS) + 2) + "|"]
    for meas, summary in measured_runs(args.runs, args.prefix):
        if "-calib" in meas.name:
            continue
        level = host_level(meas, args.profile)
        data = predict_and_compare(
            meas, summary, args.profile, args.gpu, args.work, f"{meas.name}{sfx}-host",
            extra_sets=(f"host_scale={level:.4f}",),
        )  # fmt: skip
        cells = [cell(data, k, t) for k, _, t in TARGETS]
        rows.append(f"| {meas.name} | x{level:.2f} | " + " | ".join(cells) + " |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
