"""The evidence for the decode pass's `tail_keys` term (replay.analysis.decodetail): the runs'
clean queued decode steps (replay.analysis.level.queued_decode_samples) against a profile's
decode model without its tail term and with it, and the sweep's mixed-context batches.

    python reports/fidelity/decode_tail.py --prefix 8b- \
        --profile reports/fidelity/gen/profile-h100-llama3-8b.json \
        --shapes reports/fidelity/gen/shapes-h100-llama3-8b.parquet

1. per run and band of rows: steps, median tail_keys, median measured / predicted without the
   tail term and with it (the calibration runs `*-calib` fit it; the others only judge it);
2. all runs' steps by band of rows x band of tail keys, measured / the model's bulk branch
   (replay.analysis.decodetail.bulk: the sweep's table, the term's branch) without the tail: at
   a fixed batch the ratio climbs with the tail;
3. the sweep's batches of mixed context lengths (`decode(spread)`, `decode+long`), which a
   table over mean context per row cannot hold: measured / predicted without and with the
   tail, and the excess over the tail-less bulk branch per tail key (us).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.runfmt import load_run  # noqa: E402
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape  # noqa: E402
from replay.analysis.decodetail import bulk  # noqa: E402
from replay.analysis.level import queued_decode_samples  # noqa: E402
from replay.analysis.steps import run_config, tail_keys  # noqa: E402
from sim.cost import CostModel  # noqa: E402
from sim.cost.linear import MAX_KEY, TAIL_KEYS  # noqa: E402

ROWS = ((1, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, 512))
TAILS = ((0, 256), (256, 1024), (1024, 2048), (2048, 1 << 30))


def without_tail(model: dict) -> dict:
    if MAX_KEY in model:
        return {**model, MAX_KEY: [without_tail(b) for b in model[MAX_KEY]]}
    return {k: v for k, v in model.items() if k != TAIL_KEYS}


def per_run(runs: list, decode: dict, bare: dict) -> dict[str, np.ndarray]:
    names = ("meas", "pred", "bare", "bulk", "rows", "tail")
    cols: dict[str, list] = {"run": [], **{k: [] for k in names}}
    for run in runs:
        meas, pred, rows, tail = queued_decode_samples([run], decode)
        _, pred0, _, _ = queued_decode_samples([run], bare)
        _, bulk0, _, _ = queued_decode_samples([run], bulk(bare))
        cols["run"] += [run.path.name] * len(meas)
        for k, v in zip(names, (meas, pred, pred0, bulk0, rows, tail), strict=True):
            cols[k].append(v)
    return {k: (np.array(v) if k == "run" else np.concatenate(v)) for k, v in cols.items()}


def by_run(c: dict[str, np.ndarray]) -> None:
    print("1. clean queued decode steps: measured / predicted without -> with the tail term")
    for name in sorted(set(c["run"].tolist())):
        parts = []
        for lo, hi in ROWS:
            m = (c["run"] == name) & (c["rows"] >= lo) & (c["rows"] < hi)
            if m.sum() >= 20:
                r0 = np.median(c["meas"][m] / c["bare"][m])
                r1 = np.median(c["meas"][m] / c["pred"][m])
                parts.append(f"b{lo}-{hi - 1} ({m.sum()}, tail {np.median(c['tail'][m]):.0f}) "
                             f"{r0:.3f} -> {r1:.3f}")  # fmt: skip
        print(f"  {name}: " + "; ".join(parts))


def by_tail(c: dict[str, np.ndarray]) -> None:
    print("2. all runs, measured / the bulk branch without the tail, by rows x tail keys")
    for lo, hi in ROWS:
        parts = []
        for t0, t1 in TAILS:
            m = (c["rows"] >= lo) & (c["rows"] < hi) & (c["tail"] >= t0) & (c["tail"] < t1)
            if m.sum() >= 20:
                top = "+" if t1 > 1 << 20 else f"-{t1 - 1}"
                parts.append(f"tail {t0}{top}: {np.median(c['meas'][m] / c['bulk'][m]):.3f} "
                             f"({m.sum()})")  # fmt: skip
        if parts:
            print(f"  b{lo}-{hi - 1}: " + "; ".join(parts))


def sweep_points(shapes: Path, run: object, decode: dict, bare: dict) -> None:
    import polars as pl

    print("3. the sweep's mixed-context decode batches: measured / predicted without -> with")
    cfg = run_config(run).replace(profile="")  # type: ignore[arg-type]
    models = [
        CostModel(cfg, {"version": 1, "gpu_pass": {"decode": m}})
        for m in (bare, decode, bulk(bare))
    ]
    d = pl.read_parquet(shapes).filter(
        pl.col("kind") == "decode", pl.col("label").is_in(["decode(spread)", "decode+long"])
    )
    cols = {f: d[f].to_numpy() for f in SHAPE_FIELDS}
    tail = tail_keys(run, cols["num_reqs"], cols["kv_read_tokens"], cols["max_kv_tokens"])
    for i, lab in enumerate(d["label"].to_list()):
        shape = BatchShape(**{f: int(cols[f][i]) for f in SHAPE_FIELDS})
        p0, p1, pb = (m.gpu_pass_ms(shape) for m in models)
        ms = float(d["gpu_ms"][i])
        per = f"{(ms - pb) / tail[i] * 1e3:.3f} us/key" if tail[i] else "no tail"
        print(f"  {lab} {shape.num_reqs} rows, mean {shape.kv_read_tokens / shape.num_reqs:.0f}, "
              f"max {shape.max_kv_tokens}, tail {tail[i]:.0f}: {ms / p0:.3f} -> {ms / p1:.3f} "
              f"({per})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=Path, default=ROOT / "reports/fidelity/gen/runs")
    ap.add_argument("--prefix", default="8b-")
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--shapes", type=Path)
    a = ap.parse_args()
    decode = json.loads(a.profile.read_text())["gpu_pass"]["decode"]
    bare = without_tail(decode)
    runs = [load_run(p) for p in sorted(a.runs.glob(f"{a.prefix}*")) if p.is_dir()]
    c = per_run(runs, decode, bare)
    by_run(c)
    by_tail(c)
    if a.shapes:
        sweep_points(a.shapes, runs[0], decode, bare)


if __name__ == "__main__":
    main()
