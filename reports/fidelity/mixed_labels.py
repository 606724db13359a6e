"""A profile's mixed GPU pass on a shape sweep's mixed rows, by sweep family (`label`):

    python reports/fidelity/mixed_labels.py PROFILE SWEEP RUN

measured gpu_ms / predicted per row (the simulator's `CostModel.gpu_pass_ms` with RUN's config,
as replay.analysis.steps.predicted_gpu_ms evaluates a profile), then per label: rows, median,
min, max ratio and the median |error| in %. RUN is any run folder of the sweep's model and GPU
(its config; a calibration run). Prints one table and the overall median and mean |error|.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.steps import predicted_gpu_ms  # noqa: E402


def ratios(profile: dict, sweep: Path, run: Path) -> tuple[list[str], np.ndarray]:
    """(label, measured / predicted) of the sweep's mixed rows."""
    table = pq.read_table(sweep)
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    rows = np.flatnonzero(cols["kind"] == "mixed")
    pred = predicted_gpu_ms(load_run(run), profile, cols, rows)
    return cols["label"][rows].tolist(), cols["gpu_ms"][rows] / pred


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("sweep", type=Path)
    ap.add_argument("run", type=Path)
    args = ap.parse_args()
    labels, r = ratios(json.loads(args.profile.read_text()), args.sweep, args.run)
    print("| label | rows | median | min | max | median abs err |")
    print("|---|---|---|---|---|---|")
    for lab in sorted(set(labels)):
        x = r[np.array(labels) == lab]
        err = np.median(np.abs(x - 1)) * 100
        print(f"| {lab} | {x.size} | {np.median(x):.3f} | {x.min():.3f} | {x.max():.3f} | "
              f"{err:.2f} % |")  # fmt: skip
    err = np.abs(r - 1) * 100
    print(f"\nall {r.size} rows: median |error| {np.median(err):.2f} %, mean {err.mean():.2f} %")


if __name__ == "__main__":
    main()
