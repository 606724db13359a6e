"""Simulator speed: the Azure conversation hour and a 24-hour synthetic day; prints a table,
writes JSON rows with --json PATH.

    python bench/sim_speed.py [--json PATH] [--cases azure,day] [--requests N] [--hours H]

Cases (model llama3-8b on h100 unless --set says otherwise):
- azure: traces/azure_conv.parquet (19,366 requests over ~3,500 s); a look-alike is synthesized
  when the file is missing (Poisson arrivals, lognormal prompts of mean ~1155 and outputs of
  mean ~211 tokens);
- day: the same look-alike, `--requests` requests (default 1M) over `--hours` hours (default 24),
  generated here with numpy into a temporary parquet file.
Each case runs in a fresh child process, so its peak RSS (resource.getrusage) is its own:
- sim_s: wall time of the simulation loop (SimLoop.run); cpu_s its process CPU time;
- total_s: read + validate the trace, build requests, simulate (no run folder);
- write_s: with --write, the time `write_run` then takes (the CLI's run folder);
- steps/s: simulated engine steps per second of sim_s; ff: share of steps fast-forwarded;
- rss_mb: the child's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AZURE = ROOT / "traces" / "azure_conv.parquet"
PROMPT_MEAN, OUTPUT_MEAN = 1155.0, 211.0
PROMPT_SIGMA, OUTPUT_SIGMA = 1.0, 0.9


def lookalike(path: Path, num_requests: int, duration_s: float, seed: int = 0) -> Path:
    """An Azure-conversation look-alike: Poisson arrivals, lognormal prompt/output lengths."""
    from core.trace import make_trace, write_trace

    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(duration_s / num_requests, num_requests))
    arrival -= arrival[0]

    def lognormal(mean: float, sigma: float, cap: int) -> np.ndarray:
        mu = np.log(mean) - sigma**2 / 2
        return np.clip(np.rint(rng.lognormal(mu, sigma, num_requests)), 1, cap).astype(np.int32)

    prompt = lognormal(PROMPT_MEAN, PROMPT_SIGMA, 7000)
    output = lognormal(OUTPUT_MEAN, OUTPUT_SIGMA, 1000)
    return write_trace(make_trace(arrival, prompt, output), path)


def child(case: str, trace: str, sets: list[str], fast_forward: bool, write: bool) -> None:
    """Run one case in this process and print its measurements as one JSON line."""
    import sim.run as run
    from core.config import load_config
    from sim.loop import SimLoop

    loops: list[SimLoop] = []

    def make(*args: object, **kw: object) -> SimLoop:
        loop = SimLoop(*args, fast_forward=fast_forward, **kw)  # type: ignore[arg-type]
        loops.append(loop)
        return loop

    run.SimLoop = make  # type: ignore[assignment,misc]
    cfg = load_config(None, ["model=llama3-8b", "gpu=h100", *sets])
    cpu0, t0 = time.process_time(), time.perf_counter()
    res = run.simulate(cfg, trace)
    total_s = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0
    write_s = None
    if write:
        from core.runfmt import trace_info, write_run

        with tempfile.TemporaryDirectory() as tmp:
            t1 = time.perf_counter()
            write_run(
                Path(tmp) / "run",
                res.recorder,
                config=cfg,
                trace=trace_info(trace),
                source={"kind": "sim"},
            )
            write_s = time.perf_counter() - t1
    steps = res.recorder.num_steps
    ff = loops[0].ff
    row = {
        "case": case,
        "requests": res.recorder.num_requests,
        "steps": steps,
        "sim_s": res.wall_s,
        "cpu_s": cpu_s,
        "total_s": total_s,
        "write_s": write_s,
        "steps_per_s": steps / res.wall_s if res.wall_s > 0 else None,
        "ff_share": ff.num_steps / steps if ff is not None and steps else 0.0,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "fast_forward": fast_forward,
        "config": sets,
    }
    print(json.dumps(row))


def run_case(case: str, trace: Path, args: argparse.Namespace, fast_forward: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", case, "--trace", str(trace)]
    cmd += [a for s in args.set for a in ("--set", s)]
    if not fast_forward:
        cmd.append("--no-fast-forward")
    if args.write:
        cmd.append("--write")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--cases", default="azure,day", help="comma list of azure, day")
    p.add_argument("--requests", type=int, default=1_000_000, help="day: requests")
    p.add_argument("--hours", type=float, default=24.0, help="day: duration")
    p.add_argument("--set", action="append", default=[], help="config override key=value")
    p.add_argument("--write", action="store_true", help="also time writing the run folder")
    p.add_argument("--compare", action="store_true", help="also run without fast-forward")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--trace", help=argparse.SUPPRESS)
    p.add_argument("--no-fast-forward", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.trace, args.set, not args.no_fast_forward, args.write)
        return 0

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            if case == "azure":
                trace = (
                    AZURE if AZURE.exists() else lookalike(Path(tmp) / "az.parquet", 19_366, 3500)
                )
            elif case == "day":
                t = time.perf_counter()
                trace = lookalike(Path(tmp) / "day.parquet", args.requests, args.hours * 3600)
                print(f"day trace: {args.requests:,} requests in {time.perf_counter() - t:.1f} s")
            else:
                p.error(f"unknown case {case!r}")
            for ff in (True, False) if args.compare else (True,):
                rows.append(run_case(case, trace, args, ff))
                print(_line(rows[-1]), flush=True)
    print()
    print(_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


HEAD = ("case", "ff", "requests", "steps", "sim_s", "cpu_s", "total_s", "write_s", "steps/s",
        "ff share", "rss_mb")  # fmt: skip


def _line(r: dict) -> str:
    w = "-" if r["write_s"] is None else f"{r['write_s']:.2f}"
    return (
        f"{r['case']:<6} {'on' if r['fast_forward'] else 'off':>3} {r['requests']:>9,} "
        f"{r['steps']:>11,} {r['sim_s']:>8.2f} {r['cpu_s']:>8.2f} {r['total_s']:>8.2f} {w:>8} "
        f"{r['steps_per_s'] or 0:>10,.0f} {100 * r['ff_share']:>8.1f}% {r['rss_mb']:>8.0f}"
    )


def _table(rows: list[dict]) -> str:
    head = (
        f"{'case':<6} {'ff':>3} {'requests':>9} {'steps':>11} {'sim_s':>8} {'cpu_s':>8} "
        f"{'total_s':>8} {'write_s':>8} {'steps/s':>10} {'ff share':>9} {'rss_mb':>8}"
    )
    return "\n".join([head, *(_line(r) for r in rows)])


if __name__ == "__main__":
    sys.exit(main())
