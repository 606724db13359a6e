"""Each CPU phase's measured time over the profile's, by the batch's decode rows: where a
profile's phase models hold and where they were extrapolated (reports/fidelity/README.md
section N).

    python reports/fidelity/phase_rows.py PROFILE RUN [RUN ...] [--edges 1,8,16,32,64,128,257]

For every run folder (measured, `replay run`) and every decode step (no prefill), the
simulator's phase time for the step's shape under the run's config and PROFILE
(`CostModel.cpu_phase_ms`: the base model with its active terms, at host_scale 1) against the
measured phase time less the GC pauses and sync waits inside it (replay.analysis.steps, as the
calibration reads it). A cell is mean measured / mean predicted over the steps in one band of
rows; '-' where the band holds fewer than MIN_STEPS steps. A run's cells differ by its host's
level as a whole; a profile whose phases hold their shape reads about the same across a row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.runfmt import load_run  # noqa: E402
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape  # noqa: E402
from replay.analysis.steps import load_steps, run_config  # noqa: E402
from sim.cost import CostModel, load_profile  # noqa: E402

PHASES = ("schedule", "prepare_inputs", "sample", "process_outputs")
EDGES = (1, 8, 16, 32, 64, 128, 257)
MIN_STEPS = 20


def ratios(run_dir: Path, profile: dict, edges: tuple[int, ...]) -> dict[str, list[float | None]]:
    """Phase -> mean measured / mean predicted per band of decode rows (None: too few steps)."""
    run = load_run(run_dir)
    steps = load_steps([run])
    cost = CostModel(run_config(run).replace(profile="", host_scale=1.0), profile)
    decode = steps.cols["num_prefill_reqs"] == 0
    rows = steps.cols["num_reqs"]
    idx = np.flatnonzero(decode)
    shapes = [BatchShape(**{f: int(steps.cols[f][i]) for f in SHAPE_FIELDS}) for i in idx]
    out: dict[str, list[float | None]] = {}
    for phase in PHASES:
        measured = steps.phase_ms[phase][idx]
        predicted = np.array([cost.cpu_phase_ms(phase, s) for s in shapes])
        cells: list[float | None] = []
        for lo, hi in zip(edges, edges[1:]):
            k = (rows[idx] >= lo) & (rows[idx] < hi) & np.isfinite(measured)
            ok = int(k.sum()) >= MIN_STEPS and predicted[k].sum() > 0
            cells.append(float(measured[k].mean() / predicted[k].mean()) if ok else None)
        out[phase] = cells
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", type=Path, nargs="+", help="measured run folders")
    ap.add_argument("--edges", default=",".join(map(str, EDGES)),
                    help="band edges in decode rows (a band is [lo, hi))")  # fmt: skip
    args = ap.parse_args()
    edges = tuple(int(x) for x in args.edges.split(","))
    profile = load_profile(args.profile)
    bands = [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])]
    runs = " ".join(map(str, args.runs))
    print(f"# python reports/fidelity/phase_rows.py {args.profile} {runs}")
    print("mean measured / mean predicted per band of decode rows; '-': fewer than "
          f"{MIN_STEPS} steps\n")  # fmt: skip
    table = {run_dir: ratios(run_dir, profile, edges) for run_dir in args.runs}
    for phase in PHASES:
        print(f"\n{phase}\n")
        print("| run | " + " | ".join(bands) + " |")
        print("|---" * (len(bands) + 1) + "|")
        for run_dir, by_phase in table.items():
            cells = by_phase[phase]
            text = ["-" if c is None else f"{c:.2f}" for c in cells]
            label = "/".join(run_dir.parts[-3:])
            print(f"| {label} | " + " | ".join(text) + " |")


if __name__ == "__main__":
    main()
