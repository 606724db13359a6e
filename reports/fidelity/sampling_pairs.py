"""Random sampling's measured effect beside the predicted one, and its host cost in a run.

    python reports/fidelity/sampling_pairs.py DIR GPU TAG RUNS GREEDY:SAMPLED [...]
    python reports/fidelity/sampling_pairs.py --sweep FILE [--sweep FILE ...]

DIR holds checks.py's comparisons (`<gpu>-<run>-<tag>.json`) of RUNS's measured run folders;
each pair names a greedy run and a run of the same workload sampled at random, measured on one
host one after the other (gpu_checks.sh checks5). Prints, per pair and metric, the measured
change (sampled / greedy - 1) beside the simulator's (the same ratio of its two predictions),
then each run's median sample phase on its eager steps and on its graphed steps
(replay.analysis.steps: the phase less GC pauses and sync waits): what the eager sampling of
the mode costs the host in a run, to set beside the sweep's `host_ms` (replay sampling).
`--sweep FILE`: a `replay sampling` file's table (what each mode adds over greedy at 1-1024
rows) and its host differences after engine-like work and back to back (hot).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.phases import SAMPLE  # noqa: E402
from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.sampling_file import describe, fit_sampling, hot_and_cold  # noqa: E402
from replay.analysis.steps import load_steps  # noqa: E402

METRICS = [
    ("output_tok_per_s", "tok/s"),
    ("tpot_s.p50", "TPOT p50"),
    ("ttft_s.p50", "TTFT p50"),
    ("e2e_s.p50", "e2e p50"),
    ("gpu_ms_mean", "GPU ms/step"),
]


def effect(a: dict, b: dict, key: str, side: str) -> float:
    return float(b["metrics"][key][side]) / float(a["metrics"][key][side]) - 1.0


def sample_phase(run_dir: Path) -> tuple[float, float, int]:
    """(median sample ms on eager steps, on graphed steps, eager steps)."""
    steps = load_steps([load_run(run_dir)])
    y = steps.phase_ms[SAMPLE]
    ok = np.isfinite(y)
    eager, graph = y[ok & ~steps.graph], y[ok & steps.graph]
    med = lambda v: float(np.median(v)) if v.size else float("nan")  # noqa: E731
    return med(eager), med(graph), int(eager.size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="append", default=[], type=Path, help="a sampling sweep")
    ap.add_argument("dir", type=Path, nargs="?")
    ap.add_argument("gpu", nargs="?")
    ap.add_argument("tag", nargs="?")
    ap.add_argument("runs", type=Path, nargs="?")
    ap.add_argument("pairs", nargs="*", help="GREEDY:SAMPLED run names")
    args = ap.parse_args()
    for sweep in args.sweep:
        print(f"{sweep}:")
        print("\n".join([*describe(fit_sampling(sweep)), *hot_and_cold(sweep)]))
    if not args.pairs:
        if not args.sweep:
            ap.error("give GREEDY:SAMPLED pairs (with DIR GPU TAG RUNS) or --sweep FILE")
        return
    print("| greedy -> sampled | metric | measured | predicted |")
    print("|---|---|---|---|")
    for pair in args.pairs:
        names = pair.split(":")
        a, b = (
            json.loads((args.dir / f"{args.gpu}-{n}-{args.tag}.json").read_text()) for n in names
        )
        for key, label in METRICS:
            meas, pred = effect(a, b, key, "measured"), effect(a, b, key, "predicted")
            cells = f"{100 * meas:+.1f} % | {100 * pred:+.1f} % |"
            print(f"| {names[0]} -> {names[1]} | {label} | {cells}")
    print("\n| run | sample phase, eager steps (ms) | graphed steps (ms) | eager steps |")
    print("|---|---|---|---|")
    for pair in args.pairs:
        for n in pair.split(":"):
            eager, graph, count = sample_phase(args.runs / n)
            print(f"| {n} | {eager:.3f} | {graph:.3f} | {count} |")


if __name__ == "__main__":
    main()
