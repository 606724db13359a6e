"""How much of the decode tail term each graph bucket's kernel hides, measured (section I).

    python reports/fidelity/tail_share.py SWEEP PROFILE [RUN ...]

SWEEP: a `replay shapes --families "decode(mix),decode(mix desc)"` file (the opt-in families of
replay.analysis.shapes_grid: contexts spread evenly +-50 / +-95 % around a mean, shuffled or
longest first, each beside its uniform control). PROFILE: the committed profile of the sweep's
model and GPU, whose decode model holds the tail term (`tail_keys` x its coefficient, fitted on
the calibration runs: replay.analysis.decodetail). Prints
1. per decode graph bucket, the median (spread - control) / tail_keys in us per key, shuffled
   and longest first (points with >= MIN_TAIL_KEYS tail keys), beside the profile's coefficient;
2. per RUN (measured run folders of that model and GPU), by band of rows, measured / predicted
   on the clean queued decode steps with the profile as it is, and with the tail term at the
   measured value of the step's bucket (the first swept bucket >= its rows) instead of the
   coefficient: what a per-bucket share would give before any re-levelling.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_diagnose import clean_decode_bands, tail_coefficient  # noqa: E402

from bubblesim.core.models import get_model  # noqa: E402
from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.decodetail import MIN_TAIL_KEYS  # noqa: E402
from replay.analysis.shapes_file import read_sweep  # noqa: E402
from replay.analysis.shapes_grid import MIX_FAMILIES  # noqa: E402
from replay.analysis.steps import tail_keys  # noqa: E402
from sim.cost.splits import num_sms, tail_keys_fn  # noqa: E402

ORDERS = {"shuffled": MIX_FAMILIES[0], "longest first": MIX_FAMILIES[1]}


def per_bucket(sweep: Path) -> dict[str, dict[int, float]]:
    """Order -> bucket -> median ms per tail key of its spread points."""
    cols, meta = read_sweep(sweep)
    sms = num_sms(str(meta.get("gpu", "")))
    if sms is None:
        raise SystemExit(f"{sweep}: no SM count for GPU {meta.get('gpu')!r}")
    tail = tail_keys_fn(get_model(str(meta["model"])).kv_heads_per_rank(1), sms)
    label = cols["label"].astype(str)
    rows, kv, mx = (
        cols[k].astype(np.int64) for k in ("num_reqs", "kv_read_tokens", "max_kv_tokens")
    )
    uniform = (label == MIX_FAMILIES[0]) & (mx * rows - kv < rows)
    control = {(int(r), int(k)): float(ms) for r, k, ms in
               zip(rows[uniform], kv[uniform], cols["gpu_ms"][uniform], strict=True)}  # fmt: skip
    out: dict[str, dict[int, float]] = {}
    for name, fam in ORDERS.items():
        got: dict[int, list[float]] = {}
        for i in np.flatnonzero((label == fam) & ~uniform):
            keys = tail(int(rows[i]), int(kv[i]), int(mx[i]))
            base = control.get((int(rows[i]), int(kv[i])))
            if keys >= MIN_TAIL_KEYS and base is not None:
                got.setdefault(int(rows[i]), []).append((float(cols["gpu_ms"][i]) - base) / keys)
        out[name] = {b: float(np.median(v)) for b, v in sorted(got.items())}
    return out


def at_bucket(table: dict[int, float], rows: np.ndarray) -> np.ndarray:
    """The value of the first swept bucket >= each row count (the last beyond them)."""
    buckets = np.array(sorted(table))
    idx = np.minimum(np.searchsorted(buckets, rows), len(buckets) - 1)
    return np.array([table[int(b)] for b in buckets[idx]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("sweep", type=Path)
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", nargs="*", type=Path)
    a = ap.parse_args()
    profile = json.loads(a.profile.read_text())
    coef = tail_coefficient(profile)
    tables = per_bucket(a.sweep)
    print(f"1. us per tail key by decode graph bucket ({a.sweep.name}; the profile's "
          f"coefficient: {coef * 1e3:.3f})")  # fmt: skip
    for name, table in tables.items():
        print(f"   {name:13s} " + " ".join(f"{b}:{v * 1e3:.3f}" for b, v in table.items()))
    if not a.runs:
        return
    print("2. clean queued decode steps, measured / predicted: the profile | its tail term at "
          "the bucket's measured value, " + " | ".join(tables))  # fmt: skip
    for path in a.runs:
        run = load_run(path)
        s = run.arrays("steps")
        print(f"   {path.name}")
        for lo, hi, rows, meas, pred in clean_decode_bands(run, s, profile):
            n = s["num_reqs"][rows]
            keys = tail_keys(run, n, s["kv_read_tokens"][rows], s["max_kv_tokens"][rows])
            parts = [f"{np.median(meas / pred):.3f}"]
            for table in tables.values():
                alt = pred + (at_bucket(table, n) - coef) * keys
                parts.append(f"{np.median(meas / alt):.3f}")
            print(f"     rows {lo}-{hi - 1}: " + " | ".join(parts) + f" ({rows.size} steps)")


if __name__ == "__main__":
    main()
