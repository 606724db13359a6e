"""Two predictions of the same checks side by side: mean |error| and misses per metric.

Each argument pair is a folder and a tag: the checks' comparison files `<gpu>-<run>-<tag>.json`
written by checks.py. Runs are matched by `<gpu>-<run>` (calibration runs left out), so the
two sides judge the same measured runs, e.g. before and after a model change:

    python reports/fidelity/set_errors.py reports/fidelity/gen/e e reports/fidelity/gen/g g
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checks import TARGETS, cell  # noqa: E402


def load_side(folder: Path, tag: str) -> dict[str, dict]:
    """`<gpu>-<run>` -> comparison data, for every check (not calibration) run with `tag`."""
    out = {}
    for path in sorted(folder.glob(f"*-{tag}.json")):
        data = json.loads(path.read_text())
        if data.get("role") == "calibration" or "metrics" not in data:
            continue
        out[path.name[: -len(f"-{tag}.json")]] = data
    return out


def error(data: dict, key: str) -> float:
    """The metric's error as checks.py judges it (% relative, points for the bubble)."""
    m = data["metrics"][key]
    if key == "bubble_fraction":
        return float(m["abs_error_points"])
    return 100 * float(m["rel_error"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("before_tag")
    ap.add_argument("after", type=Path)
    ap.add_argument("after_tag")
    args = ap.parse_args()
    a, b = load_side(args.before, args.before_tag), load_side(args.after, args.after_tag)
    runs = sorted(set(a) & set(b))
    if not runs:
        sys.exit(f"no run has both a '{args.before_tag}' and an '{args.after_tag}' comparison")
    print(f"{len(runs)} checks: {', '.join(runs)}")
    print("| metric | mean abs error before | after | misses before | after |")
    print("|---|---|---|---|---|")
    for key, col, target in TARGETS:
        if target is None:
            continue
        ea = [abs(error(a[r], key)) for r in runs]
        eb = [abs(error(b[r], key)) for r in runs]
        ma = sum(not cell(a[r], key, target).startswith("**") for r in runs)
        mb = sum(not cell(b[r], key, target).startswith("**") for r in runs)
        unit = "pt" if key == "bubble_fraction" else "%"
        print(
            f"| {col} | {sum(ea) / len(ea):.2f} {unit} | {sum(eb) / len(eb):.2f} {unit} "
            f"| {ma} | {mb} |"
        )


if __name__ == "__main__":
    main()
