"""The host speed's evidence on the measured runs (docs/cost-model.md, "Host speed"): per run,
the steps' log(measured / predicted host time) in 50 ms bins, its sd and the bins'
autocorrelation by lag, with a committed profile (nothing is fitted here; `replay calibrate`
fits `host_speed` on the calibration runs alone; the checks are shown for judgement only):

    python reports/fidelity/host_speed.py --prefix 8b- \
        --profile reports/fidelity/gen/profile-h100-llama3-8b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.hostspeed import binned, run_report, step_log_speeds  # noqa: E402
from replay.analysis.steps import load_steps  # noqa: E402
from sim.cost import resolve_profile  # noqa: E402


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
        (series,) = step_log_speeds(prof, [run], load_steps([run]))
        rep = run_report(series, binned(series)[0])
        role = "calibration" if "-calib" in path.name else "check"
        acf = " ".join(
            f"{lag}:{r:+.2f}" if r is not None else f"{lag}:-" for lag, r in rep["acf"].items()
        )
        print(
            f"{path.name} | {role} | {rep['steps']} | {rep['bins']} | {rep['step_sd']:.3f} | "
            f"{rep['bin_sd']:.3f} | {acf}"
        )


if __name__ == "__main__":
    main()
