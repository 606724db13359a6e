"""A run's decode batches timed alone: is a step's GPU time its batch's own, and which part of the
decode model misses it (section J)?

    python reports/fidelity/isolate.py prep PROFILE RUN... -o BATCHES.json [--per-run N]
    python -m replay shapes --set model=M --set num_kv_blocks=B --batches BATCHES.json -o SWEEP
    python reports/fidelity/isolate.py report BATCHES.json SWEEP [--mix-sweep MIX]

`prep` (CPU) takes up to N (default 80) of each RUN's clean queued decode steps at >= 64 rows
(`--min-rows`),
evenly, whose contexts reports/fidelity/wave_tail.py rebuilds exactly, and writes a
replay.analysis.batches_file: per step the batch as it ran ("RUN:STEP:mixed", rows in batch
order) and its uniform twin ("RUN:STEP:uniform": as many rows, as many keys, spread as evenly as
integers allow: what the decode table is fitted on), each with the step's measured GPU ms and
the profile's predictions (its pass, the twin's pass, the tail term, and the list schedule's
excess in keys: wave_tail.excess at the model's measured slots).

`replay shapes --batches` (GPU) times every batch alone, as the sweep times its grid.

`report` (CPU) prints per run: in-run / alone (the step's time is its batch's own when ~1), the
uniform twin alone / the profile's pass for it (the table at these shapes), and the measured
excess (mixed - twin, both alone) against the profile's tail term and against the list
schedule's excess x the ms per key a decode(mix) sweep fits (`--mix-sweep`), with the
correlation of each over the steps; then each refitted to the measured excess over all the
steps (one scale, no intercept), with per run the median fitted / measured, and the pass a
model with that term would predict per run (its scale fitted without the run), measured /
predicted, beside the profile's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_diagnose import clean_decode_bands, tail_coefficient  # noqa: E402
from wave_tail import BLOCKS_PER_SM, RunKernel, fit, rebuilt, row_contexts, sweep_fit  # noqa: E402

from replay.analysis.batches_file import batches_doc, read_batches  # noqa: E402
from replay.analysis.shapes_file import read_sweep  # noqa: E402
from replay.analysis.steps import predicted_gpu_ms, run_config, tail_keys  # noqa: E402

MIN_ROWS = 64


def uniform(ctx: list[int]) -> list[int]:
    """As many rows as `ctx` reading as many keys in all, as evenly as integers allow (the
    longer rows first)."""
    base, extra = divmod(sum(ctx), len(ctx))
    return [base + 1] * extra + [base] * (len(ctx) - extra)


def prep(
    profile_path: Path, runs: list[Path], out: Path, per_run: int, min_rows: int = MIN_ROWS
) -> int:
    """Write the batches file (module docstring); returns the number of steps taken."""
    profile = json.loads(profile_path.read_text())
    coef = tail_coefficient(profile)
    pairs: list[tuple[str, list[int]]] = []
    info: dict[str, dict[str, Any]] = {}
    for path in runs:
        run, s, rows = row_contexts(path)
        kernel = RunKernel.of(run, profile)
        slots = BLOCKS_PER_SM[run_config(run).model] * kernel.sms
        for _, hi, steps, meas, pred in clean_decode_bands(run, s, profile):
            if hi <= min_rows:
                continue
            ok = [
                (i, j, ctx)
                for i, j in enumerate(steps.tolist())
                if s["num_reqs"][j] >= min_rows and (ctx := rebuilt(rows, s, j)) is not None
            ]
            take = np.unique(np.linspace(0, len(ok) - 1, min(per_run, len(ok))).round().astype(int))
            chosen = [ok[t] for t in take.tolist()] if ok else []
            if not chosen:
                continue
            idx = np.array([j for _, j, _ in chosen])
            twin = {k: v[idx].copy() for k, v in s.items()}
            twin["max_kv_tokens"] = np.array([max(uniform(c)) for _, _, c in chosen])
            pred_twin = predicted_gpu_ms(run, profile, twin, np.arange(idx.size))
            keys = tail_keys(run, s["num_reqs"][idx], s["kv_read_tokens"][idx],
                             s["max_kv_tokens"][idx])  # fmt: skip
            for n, (i, j, ctx) in enumerate(chosen):
                name = f"{path.name}:{j}"
                pairs += [(f"{name}:mixed", ctx), (f"{name}:uniform", uniform(ctx))]
                info[name] = {
                    "run": path.name, "step": j, "rows": len(ctx), "measured_ms": float(meas[i]),
                    "predicted_ms": float(pred[i]), "predicted_uniform_ms": float(pred_twin[n]),
                    "tail_term_ms": float(coef * keys[n]),
                    "excess_keys": kernel.excess(ctx, slots),
                }  # fmt: skip
    doc = batches_doc(pairs)
    doc["steps"] = info
    out.write_text(json.dumps(doc))
    return len(info)


def _r(a: np.ndarray, b: np.ndarray) -> str:
    """Pearson's r, or '-' where either side does not vary."""
    if a.std() == 0 or b.std() == 0:
        return "-"
    return f"{np.corrcoef(a, b)[0, 1]:.2f}"


def report(batches_path: Path, sweep_path: Path, mix_sweep: Path | None) -> list[str]:
    """The report's lines (module docstring)."""
    doc = json.loads(batches_path.read_text())
    read_batches(batches_path)  # checked as the sweep read it
    cols, meta = read_sweep(sweep_path)
    alone = {str(k): float(v) for k, v in zip(cols["label"], cols["gpu_ms"], strict=True)}
    per_key = sweep_fit(mix_sweep, None)["ms_per_key"] if mix_sweep is not None else None
    lines = [f"{sweep_path.name} ({meta.get('model')}, {meta.get('gpu')}): batches timed alone"]
    if per_key is not None:
        lines.append(f"the list schedule's excess at {per_key * 1e3:.4f} us per key ({mix_sweep})")
    by_run: dict[str, list[dict[str, Any]]] = {}
    for name, st in doc["steps"].items():
        mixed, twin = alone.get(f"{name}:mixed"), alone.get(f"{name}:uniform")
        if mixed is not None and twin is not None:
            by_run.setdefault(st["run"], []).append({**st, "alone": mixed, "twin": twin})
    for run, sts in by_run.items():
        a = {k: np.array([st[k] for st in sts]) for k in sts[0] if k != "run"}
        in_run = a["measured_ms"] / a["alone"]
        ex = a["alone"] - a["twin"]
        q25, q75 = np.quantile(in_run, (0.25, 0.75))
        lines.append(
            f"{run}: {len(sts)} steps, rows {int(a['rows'].min())}-{int(a['rows'].max())}; "
            f"in-run / alone {np.median(in_run):.3f} (q25 {q25:.3f}, q75 {q75:.3f}); twin alone "
            f"/ the profile's pass for it {np.median(a['twin'] / a['predicted_uniform_ms']):.3f}"
        )
        tail = a["tail_term_ms"]
        parts = [
            f"excess alone (mixed - twin) {np.median(ex):.3f} ms; the profile's tail term "
            f"{np.median(tail):.3f} ms (r {_r(ex, tail)})"
        ]
        if per_key is not None:
            ls = per_key * a["excess_keys"]
            parts.append(f"the list schedule {np.median(ls):.3f} ms (r {_r(ex, ls)})")
        lines.append("   " + "; ".join(parts))
    lines += _refit(by_run)
    return lines


def _refit(by_run: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each candidate refitted to the measured excess over every run's steps (least squares,
    no intercept): its scale, R^2, and per run the median fitted / measured excess; then the
    pass a model with that term would predict (the profile's pass for the twin + the term,
    scaled without the run's own steps: leave one run out), measured in the run / predicted,
    beside the profile's."""
    sts = [st for v in by_run.values() for st in v]
    if not sts:
        return []
    y = np.array([st["alone"] - st["twin"] for st in sts])
    runs = np.array([st["run"] for st in sts])
    meas = np.array([st["measured_ms"] for st in sts])
    base = np.array([st["predicted_uniform_ms"] for st in sts])
    prof = np.array([st["predicted_ms"] for st in sts])
    out = ["refitted on every step above (no intercept): scale, R^2, per run fitted / measured"]
    passes = {"the profile": {r: np.median((meas / prof)[runs == r]) for r in by_run}}
    for name, key in (("the tail term", "tail_term_ms"), ("the excess keys", "excess_keys")):
        x = np.array([st[key] for st in sts], dtype=float)
        c, r2 = fit(x, y)
        per = ", ".join(
            f"{run} {np.median(c * x[runs == run]) / np.median(y[runs == run]):.3f}"
            for run in by_run
        )
        out.append(f"   {name}: x {c:.6g}, R^2 {r2:.3f}; {per}")
        if len(by_run) > 1:
            passes[name] = {}
            for run in by_run:
                own = runs == run
                c_out = fit(x[~own], y[~own])[0]
                passes[name][run] = np.median(meas[own] / (base[own] + c_out * x[own]))
    if len(passes) > 1:
        out.append("the pass, measured in the run / predicted (the twin's pass + the term, its "
                   "scale fitted on the other runs):")  # fmt: skip
        for name, per_run in passes.items():
            out.append(f"   {name}: " + ", ".join(f"{r} {v:.3f}" for r, v in per_run.items()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep")
    p.add_argument("profile", type=Path)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--per-run", type=int, default=80)
    p.add_argument("--min-rows", type=int, default=MIN_ROWS)
    r = sub.add_parser("report")
    r.add_argument("batches", type=Path)
    r.add_argument("sweep", type=Path)
    r.add_argument("--mix-sweep", type=Path, default=None)
    a = ap.parse_args()
    if a.cmd == "prep":
        n = prep(a.profile, a.runs, a.output, a.per_run, a.min_rows)
        print(f"{n} steps ({2 * n} batches) -> {a.output}")
    else:
        print("\n".join(report(a.batches, a.sweep, a.mix_sweep)))


if __name__ == "__main__":
    main()
