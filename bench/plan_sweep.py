"""Sweep throughput of `sim plan`: N engine configurations over a trace on the local pool.

    python bench/plan_sweep.py                       # 200 configs, Azure conversation hour
    python bench/plan_sweep.py --points 16 --jobs 2 --json out.json
    python bench/plan_sweep.py --limit-s 600         # the trace's first 10 minutes only

Each point is one replica of one config at the trace's load with the SLOs watched (a run
stops once it surely misses one, as in a plan), run through the plan's driver and point store
exactly as `python -m sim plan` runs them (fresh store: nothing from an earlier run). The
configs are a seeded shuffle of a grid (gpu x batches_in_flight x max_num_seqs x
max_num_batched_tokens x spec method), so any N is a fair sample. Points that differ only in a
max_num_seqs their run never met share that run (bubblesim/plan/sweep.py, exact; they count 0 s);
`--no-reuse` runs every point. Prints per-point times (all, and with and without speculative
decoding) and the wall time a sweep of 200 would take at the measured rate with these jobs.
The target: 200 in <= 300 s on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bubblesim.core.config import Config  # noqa: E402
from bubblesim.core.runfmt import trace_info  # noqa: E402
from bubblesim.core.trace import read_trace, write_trace  # noqa: E402
from bubblesim.plan.points import Point, PointStore  # noqa: E402
from bubblesim.plan.spec import parse_slos  # noqa: E402
from bubblesim.plan.sweep import Driver, make_executor  # noqa: E402

GRID: dict[str, list[Any]] = {
    "gpu": ["h100", "h200", "a100"],
    "batches_in_flight": [1, 2, 3],
    "max_num_seqs": [32, 64, 128, 256, 512],
    "max_num_batched_tokens": [2048, 4096, 8192, 16384],
    "spec.method": ["none", "ngram-gpu"],
}
TARGET_POINTS, TARGET_S = 200, 300.0


def configs(n: int) -> list[Config]:
    combos = list(itertools.product(*GRID.values()))
    order = np.random.default_rng(0).permutation(len(combos))
    picked = [combos[i] for i in order[: min(n, len(combos))]]
    return [Config().replace(**dict(zip(GRID, c))) for c in picked]


def _one(point: Point) -> Any:
    (result,) = yield [point]
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    trace_path = Path(args.trace)
    tmp = Path(tempfile.mkdtemp(prefix="plan-bench-"))
    if args.limit_s:
        tr = read_trace(trace_path)
        trace_path = write_trace(
            tr.take(np.flatnonzero(tr.arrival_s < args.limit_s)), tmp / "trace.parquet"
        )
    info = trace_info(trace_path)
    slos = parse_slos(args.slo or ["ttft_p99_s=1", "tpot_p99_s=0.05"])
    cfgs = configs(args.points)
    points = [Point(c.to_dict(), 1, 1.0, "round-robin") for c in cfgs]
    store = PointStore(tmp / "points.jsonl", resume=False)
    ex = make_executor(args.jobs, None, str(trace_path))
    driver = Driver(
        ex, store, str(trace_path), info["sha256"], slos, not args.no_early_stop,
        reuse=not args.no_reuse,
    )  # fmt: skip
    t0 = time.perf_counter()
    results = driver.run({i: _one(p) for i, p in enumerate(points)})
    wall_s = time.perf_counter() - t0
    rows = []
    for i, c in enumerate(cfgs):
        r = results[i]
        stop = r["stopped"] or {}
        rows.append(
            {
                "gpu": c.gpu,
                "batches_in_flight": c.batches_in_flight,
                "max_num_seqs": c.max_num_seqs,
                "max_num_batched_tokens": c.max_num_batched_tokens,
                "spec": c.spec.method,
                "wall_s": r["wall_s"],
                "cpu_s": r["cpu_s"],
                "stopped": not r["complete"],
                "stopped_at_s": stop.get("at_s"),
                "steps": r["sim"]["steps"],
            }
        )
    s = summarize(args, info, rows, wall_s)
    s["same_run_points"] = driver.stats.same
    s["cpu_s_sum"] = driver.stats.cpu_s_sum
    return s


def _stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    w = np.array([r["wall_s"] for r in rows]) if rows else np.zeros(0)
    c = np.array([r["cpu_s"] for r in rows]) if rows else np.zeros(0)
    return {
        "points": len(rows),
        "stopped": sum(r["stopped"] for r in rows),
        "mean_s": float(w.mean()) if w.size else None,
        "p50_s": float(np.median(w)) if w.size else None,
        "max_s": float(w.max()) if w.size else None,
        "cpu_mean_s": float(c.mean()) if c.size else None,
        "cpu_sum_s": float(c.sum()),
    }


def summarize(
    args: argparse.Namespace, info: dict[str, Any], rows: list[dict[str, Any]], wall_s: float
) -> dict[str, Any]:
    rate = len(rows) / wall_s if wall_s > 0 else 0.0
    projected = TARGET_POINTS / rate if rate else None
    cpu = [r["cpu_s"] for r in rows]
    # what the same points would take with `jobs` cores to themselves (no other load)
    dedicated = TARGET_POINTS * float(np.mean(cpu)) / max(args.jobs, 1) if cpu else None
    return {
        "trace": info["path"],
        "trace_rows": info["rows"],
        "jobs": args.jobs,
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "wall_s": wall_s,
        "points_per_min": 60 * rate,
        "projected_200_s": projected,
        "projected_200_dedicated_s": dedicated,
        "target_met": projected is not None and projected <= TARGET_S,
        "rows": rows,
        "all": _stats(rows),
        "no_spec": _stats([r for r in rows if r["spec"] == "none"]),
        "spec": _stats([r for r in rows if r["spec"] != "none"]),
    }


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(s: dict[str, Any]) -> None:
    print(
        f"plan sweep: {s['trace']} ({s['trace_rows']} requests), jobs={s['jobs']}, "
        f"cpus={s['cpus']}, load avg {s['load_avg_1m']:.1f}"
    )
    print(
        f"{'points':<10} {'n':>5} {'stopped':>8} {'mean s':>8} {'p50 s':>8} {'max s':>8} "
        f"{'cpu s':>8}"
    )
    for key in ("all", "no_spec", "spec"):
        st = s[key]
        print(
            f"{key:<10} {st['points']:>5} {st['stopped']:>8} {_f(st['mean_s']):>8} "
            f"{_f(st['p50_s']):>8} {_f(st['max_s']):>8} {_f(st['cpu_mean_s']):>8}"
        )
    print(
        f"wall {s['wall_s']:.1f} s, {s['points_per_min']:.1f} points/min; 200 points -> "
        f"{_f(s['projected_200_s'], '.0f')} s (target <= {TARGET_S:.0f} s: "
        f"{'met' if s['target_met'] else 'NOT met'}); with {s['jobs']} cores to itself "
        f"(mean CPU s per point): {_f(s['projected_200_dedicated_s'], '.0f')} s"
    )
    print(
        f"{s['same_run_points']} of {s['all']['points']} points answered by the run of a point "
        f"that differs only in a max_num_seqs it never met; CPU s of the runs: "
        f"{s['cpu_s_sum']:.0f}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="traces/azure_conv.parquet")
    p.add_argument("--points", type=int, default=TARGET_POINTS)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--limit-s", type=float, default=0.0, help="use the trace's first S seconds")
    p.add_argument("--slo", action="append", help="default ttft_p99_s=1, tpot_p99_s=0.05")
    p.add_argument("--no-early-stop", action="store_true")
    p.add_argument("--no-reuse", action="store_true", help="run every point (no shared runs)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    s = run(args)
    print_table(s)
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
