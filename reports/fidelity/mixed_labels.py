"""A profile's mixed GPU pass on a shape sweep's mixed rows, by sweep family (`label`):

    python reports/fidelity/mixed_labels.py PROFILE SWEEP RUN

measured gpu_ms / predicted per row (the simulator's `CostModel.gpu_pass_ms` with RUN's config,
as replay.analysis.steps.predicted_gpu_ms evaluates a profile), then per label: rows, median,
min, max ratio and the median |error| in %. RUN is any run folder of the sweep's model and GPU
(its config; a calibration run). Prints one table and the overall median and mean |error|.
`--same-shapes OTHER`: also the median of SWEEP's gpu_ms over OTHER's for the mixed shapes both
swept (the same label and shape fields): two hosts' or days' sweeps side by side.
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
from bubblesim.core.shape import SHAPE_FIELDS  # noqa: E402
from replay.analysis.steps import predicted_gpu_ms  # noqa: E402


def ratios(profile: dict, sweep: Path, run: Path) -> tuple[list[str], np.ndarray]:
    """(label, measured / predicted) of the sweep's mixed rows."""
    table = pq.read_table(sweep)
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    rows = np.flatnonzero(cols["kind"] == "mixed")
    pred = predicted_gpu_ms(load_run(run), profile, cols, rows)
    return cols["label"][rows].tolist(), cols["gpu_ms"][rows] / pred


def same_shapes(sweep: Path, other: Path) -> str:
    """Median gpu_ms of `sweep` over `other` on the mixed rows both hold (label + shape)."""
    key = ("label", *SHAPE_FIELDS)
    theirs = {tuple(r[k] for k in key): r["gpu_ms"] for r in _mixed_rows(other)}
    both = [
        r["gpu_ms"] / theirs[k]
        for r in _mixed_rows(sweep)
        if (k := tuple(r[f] for f in key)) in theirs
    ]
    if not both:
        return "no mixed shape in both sweeps"
    return (
        f"{len(both)} mixed shapes in both sweeps: x{np.median(both):.3f} of the other's (median)"
    )


def _mixed_rows(sweep: Path) -> list[dict]:
    return [r for r in pq.read_table(sweep).to_pylist() if r["kind"] == "mixed"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("sweep", type=Path)
    ap.add_argument("run", type=Path)
    ap.add_argument("--same-shapes", type=Path, help="another sweep of the model and GPU")
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
    if args.same_shapes is not None:
        print(same_shapes(args.sweep, args.same_shapes))


if __name__ == "__main__":
    main()
