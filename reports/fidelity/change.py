"""A config change measured on one host beside the simulator's prediction of it.

    python reports/fidelity/change.py BEFORE.json AFTER.json [BEFORE.json AFTER.json ...]

Each JSON is a check's comparison as `reports/fidelity/checks.py` writes it
(`<gpu>-<run>-<tag>.json`: predicted and measured metrics of one measured run and its
prediction), or a `fidelity.json` of `replay compare` (named by its folder: e.g. host_level.py's
WORK/fid-<run>-<tag>-host). Given the same workload measured before and after a change (e.g.
depth 2 and depth 3, run back to back on one GPU host), prints per metric the measured change
and the predicted change: relative for latencies and throughput, in points for the bubble
fraction. A measured change holds whatever moved between the two runs besides the config (the
host's level above all); `host_level.py` on both runs says how much that was.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METRICS = [
    ("output_tok_per_s", "tok/s"),
    ("tpot_s.p50", "TPOT p50"),
    ("tpot_s.p99", "TPOT p99"),
    ("ttft_s.p50", "TTFT p50"),
    ("e2e_s.p50", "e2e p50"),
    ("bubble_fraction", "bubble"),
]


def change(before: dict, after: dict, side: str, key: str) -> float:
    """After against before on one side (`predicted` or `measured`): % or, for bubbles, points."""
    b, a = before["metrics"][key][side], after["metrics"][key][side]
    if key == "bubble_fraction":
        return (a - b) * 100.0
    return (a / b - 1.0) * 100.0


def row(before_path: Path, after_path: Path) -> str:
    before = json.loads(before_path.read_text())
    after = json.loads(after_path.read_text())
    cells = []
    for key, _ in METRICS:
        unit = " pt" if key == "bubble_fraction" else " %"
        measured = change(before, after, "measured", key)
        predicted = change(before, after, "predicted", key)
        digits = 2 if key == "bubble_fraction" else 1
        cells.append(f"{measured:+.{digits}f} / {predicted:+.{digits}f}{unit}")
    name = f"{_name(before_path)} -> {_name(after_path)}"
    return f"| {name} | " + " | ".join(cells) + " |"


def _name(path: Path) -> str:
    """A comparison's name: its file's, or its folder's for `replay compare`'s fidelity.json."""
    return path.parent.name if path.name == "fidelity.json" else path.stem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", type=Path, nargs="+", help="BEFORE.json AFTER.json, repeated")
    args = ap.parse_args()
    if len(args.pairs) % 2:
        ap.error("give the comparisons in pairs: BEFORE.json AFTER.json")
    for p in args.pairs:
        if not p.is_file():
            ap.error(f"no such comparison file: {p}")
    head = "| change (measured / predicted) | " + " | ".join(c for _, c in METRICS) + " |"
    print(head)
    print("|---" * (len(METRICS) + 1) + "|")
    for i in range(0, len(args.pairs), 2):
        print(row(args.pairs[i], args.pairs[i + 1]))


if __name__ == "__main__":
    main()
