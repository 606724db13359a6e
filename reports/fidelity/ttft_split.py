"""A run's time to first token split at each request's prefill step (section I).

    python reports/fidelity/ttft_split.py RUN [RUN ...]

For each run folder (measured or simulated), each request's prefill step is taken as the first
eager (prefill or mixed) step scheduled at or after its arrival. Prints the medians of the queue
before that step (its schedule start - arrival), its launch (schedule start -> launch end), its
sample phase and how long its GPU pass ran past its launch's end, and the quantiles (25, 50, 75,
90 %) of the time from its sample's end to the first token and of the TTFT itself; and how often
the next step is eager too; then the means of the four parts, which add up to the mean TTFT
(medians do not add: a first token that waits behind the next eager step puts the TTFT's median
in the short ones' upper quantiles, so a part's tail moves it). A measured run and
its prediction (a sim run folder, e.g. host_level.py's `--work` folder) side by side show which
part of the first token's path the prediction misses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.runfmt import load_run  # noqa: E402

QUANTILES = (25, 50, 75, 90)
PARTS = ("queue", "launch", "sample", "after")  # each request's TTFT is their sum


def split(path: Path) -> dict[str, np.ndarray]:
    """Per request (those with a prefill step found): ms of each part of its first token."""
    run = load_run(path)
    s = run.arrays("steps")
    arrival = np.asarray(run.requests.column("arrival_s"), dtype=float)
    first = np.asarray(run.requests.column("first_token_s"), dtype=float)
    eager = np.flatnonzero(s["num_prefill_reqs"] > 0)
    starts = s["schedule_start_s"][eager]
    at = np.searchsorted(starts, arrival)
    ok = (at < len(eager)) & np.isfinite(first)
    step = eager[at[ok]]
    begin = s["schedule_start_s"][step]
    return {
        "queue": (begin - arrival[ok]) * 1e3,
        "launch": (s["launch_end_s"][step] - begin) * 1e3,
        "sample": (s["sample_end_s"][step] - s["launch_end_s"][step]) * 1e3,
        "pass_tail": (s["gpu_end_s"][step] - s["launch_end_s"][step]) * 1e3,
        "after": (first[ok] - s["sample_end_s"][step]) * 1e3,
        "ttft": (first[ok] - arrival[ok]) * 1e3,
        "next_eager": np.isin(step + 1, eager).astype(float),
    }


def line(name: str, parts: dict[str, np.ndarray]) -> str:
    def qs(x: np.ndarray) -> str:
        return " ".join(f"{v:6.2f}" for v in np.percentile(x, QUANTILES))

    med = {k: float(np.median(v)) for k, v in parts.items()}
    return (
        f"{name}: queue {med['queue']:.2f}, launch {med['launch']:.2f}, sample "
        f"{med['sample']:.2f}, pass past the launch {med['pass_tail']:.2f} ms (medians); "
        f"sample end -> first token q{QUANTILES} "
        f"{qs(parts['after'])}; TTFT {qs(parts['ttft'])}; next step eager "
        f"{parts['next_eager'].mean():.2f}\n  means: "
        + " + ".join(f"{k} {parts[k].mean():.2f}" for k in PARTS)
        + f" = TTFT {parts['ttft'].mean():.2f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    for path in ap.parse_args().runs:
        print(line(path.name, split(path)))


if __name__ == "__main__":
    main()
