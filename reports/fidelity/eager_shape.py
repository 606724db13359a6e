"""The shape of each run's eager (prefill/mixed) launches (section K).

    python reports/fidelity/eager_shape.py RUN [RUN ...]

Per run folder (measured or simulated): how many eager launches, their median in ms, their mean
over the median, their 10th, 25th, 75th and 90th percentiles over the median, and the 10th in ms
(the floor: it moves far less than the median between hosts and within a lease). A fast host's
eager launches sit on a floor (p10 ~0.85-0.9 x the median) with a long right tail (mean ~1.2 x);
a slow host's spread is wider below and about symmetric. The profile's launch spread is its
calibration run's, whatever the host does later (host_level.py --eager-shape takes a run's own).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.phases import LAUNCH  # noqa: E402
from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.steps import load_steps  # noqa: E402

QUANTILES = (10, 25, 75, 90)


def eager_launch_ms(path: Path) -> np.ndarray:
    """A run's eager launches in ms (finite ones, in step order)."""
    steps = load_steps([load_run(path)])
    y = steps.phase_ms[LAUNCH][~steps.graph]
    return y[np.isfinite(y)]


def shape_line(name: str, y: np.ndarray) -> str:
    if y.size == 0:
        return f"{name}: no eager launch"
    med = float(np.median(y))
    qs = " ".join(f"p{q} {v / med:.2f}" for q, v in zip(QUANTILES, np.percentile(y, QUANTILES)))
    floor = float(np.percentile(y, QUANTILES[0]))
    return (
        f"{name}: n {y.size}, median {med:.2f} ms, mean/median {y.mean() / med:.2f}, {qs}; "
        f"p{QUANTILES[0]} {floor:.2f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    for path in ap.parse_args().runs:
        print(shape_line(f"{path.parent.name}/{path.name}", eager_launch_ms(path)))


if __name__ == "__main__":
    main()
