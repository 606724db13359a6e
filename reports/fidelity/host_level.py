"""Attribution, not prediction: how much of a check's miss is its host's level.

For each measured check, the host's level against the profile's is the ratio of the measured
CPU phases' mean time per step to the predicted one (schedule, prepare_inputs, launch, sample,
draft, process_outputs; the comparison `checks.py` wrote); the check is then predicted again
with `--set host_scale=<level>` and judged on the same targets. This READS the measured run, so
its table is no prediction: it says which misses a known host level would remove (the rest are
the model's).

    python reports/fidelity/host_level.py PROFILE RUNS_DIR --gpu h100 --prefix 1b- --tag set2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checks import ROOT, TARGETS, cell, sh, sim_sets  # noqa: E402

PHASES = ("schedule", "prepare_inputs", "launch", "sample", "draft", "process_outputs")


def host_level(fid: dict) -> float:
    """Measured over predicted mean CPU time per step, over the launch phases."""
    m = fid["metrics"]
    meas = sum(m[f"cpu_ms_mean.{p}"]["measured"] for p in PHASES if f"cpu_ms_mean.{p}" in m)
    pred = sum(m[f"cpu_ms_mean.{p}"]["predicted"] for p in PHASES if f"cpu_ms_mean.{p}" in m)
    return meas / pred if pred > 0 else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", type=Path)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--prefix", default="")
    ap.add_argument("--tag", default="", help="the tag checks.py used for these runs")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "checks-work")
    args = ap.parse_args()
    sfx = f"-{args.tag}" if args.tag else ""
    head = "| run | host level | " + " | ".join(c for _, c, _ in TARGETS) + " |"
    rows = [head, "|---" * (len(TARGETS) + 2) + "|"]
    for meas in sorted(p for p in args.runs.iterdir() if (p / "summary.json").is_file()):
        if not meas.name.startswith(args.prefix) or "-calib" in meas.name:
            continue
        base_fid = args.work / f"fid-{meas.name}{sfx}" / "fidelity.json"
        if not base_fid.is_file():
            raise SystemExit(f"{base_fid} missing: run checks.py with --tag {args.tag!r} first")
        level = host_level(json.loads(base_fid.read_text()))
        summary = json.loads((meas / "summary.json").read_text())
        pred = args.work / f"sim-{meas.name}{sfx}-host"
        sh("-m", "sim", "run", str(ROOT / summary["trace"]["path"]), "-q", "--force", "-o",
           str(pred), *sim_sets(summary["config"], args.profile, args.gpu),
           "--set", f"host_scale={level:.4f}")  # fmt: skip
        fid = args.work / f"fid-{meas.name}{sfx}-host"
        sh("-m", "replay", "compare", str(pred), str(meas), "--force", "-o", str(fid))
        data = json.loads((fid / "fidelity.json").read_text())
        cells = [cell(data, k, t) for k, _, t in TARGETS]
        rows.append(f"| {meas.name} | x{level:.2f} | " + " | ".join(cells) + " |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
