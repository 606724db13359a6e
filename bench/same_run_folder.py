"""Whether two run folders hold the same run: every table equal (floats bit for bit, NaN
included; schemas with their metadata), summary.json equal but for what differs between any two
runs (`sim.wall_s`, the trace's `path`), and each written file byte for byte.

    python bench/same_run_folder.py BEFORE_DIR AFTER_DIR

Prints one line per file; exits 1 at the first difference (naming it). For checking that a
change to the run-folder code (bubblesim.core.runfmt) leaves its output as it was.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bubblesim.core.runfmt import load_run  # noqa: E402
from bubblesim.core.runfmt.io import RUN_FILES, SUMMARY  # noqa: E402

VARYING = (("sim", "wall_s"), ("trace", "path"))  # summary keys that differ run to run


def _tables_differ(a: Path, b: Path) -> str | None:
    ra, rb = load_run(a), load_run(b)
    for name in ("requests", "step_table", "gc"):
        ta, tb = getattr(ra, name), getattr(rb, name)
        if ta is None or tb is None:
            if (ta is None) != (tb is None):
                return f"{name}: in one folder only"
            continue
        if not ta.schema.equals(tb.schema, check_metadata=True):
            return f"{name}: schemas differ"
        for col in ta.column_names:
            x, y = ta.column(col), tb.column(col)
            if pa.types.is_float64(x.type):
                same = np.array_equal(x.to_numpy().view(np.int64), y.to_numpy().view(np.int64))
            else:
                same = x.equals(y)
            if not same:
                return f"{name}: column {col!r} differs"
    return None


def _summary(path: Path) -> dict:
    s = json.loads((path / SUMMARY).read_text())
    for outer, inner in VARYING:
        s.get(outer, {}).pop(inner, None)
    return s


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    a, b = Path(sys.argv[1]), Path(sys.argv[2])
    why = _tables_differ(a, b)
    if why is None and _summary(a) != _summary(b):
        sa, sb = _summary(a), _summary(b)
        why = f"summary.json: key(s) {[k for k in sa.keys() | sb.keys() if sa.get(k) != sb.get(k)]}"
    if why is not None:
        print(f"DIFFERENT {why}")
        return 1
    for name in RUN_FILES:
        fa, fb = a / name, b / name
        if not fa.exists() and not fb.exists():
            continue
        if name == SUMMARY:
            print(f"{name}: same (but {', '.join('.'.join(k) for k in VARYING)})")
            continue
        if not (fa.exists() and fb.exists() and fa.read_bytes() == fb.read_bytes()):
            print(f"DIFFERENT {name}: bytes differ (its table reads back the same)")
            return 1
        print(f"{name}: same bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
