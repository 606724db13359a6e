"""Wall time of `sim run --seeds N --host-band` with its extra runs one after another (--jobs 1)
and on a pool beside the main run (sim.siderun), and whether both wrote the same results.

    python bench/side_runs.py                          # Azure hour, llama3-8b H100 states profile
    python bench/side_runs.py --jobs 2,4 --seeds 6 --write rows.json
    python bench/side_runs.py --trace traces/checks2/azure_mid.parquet --set model=llama3.2-1b \\
        --profile reports/fidelity/gen/l/profile-h100-llama3.2-1b-states.json

Each row is one `python -m sim run` end to end (imports, trace, the main run and its folder,
the extra runs, summary.json). `same` compares summary.json's seed_spread and host_band with
the --jobs 1 row's. The machine may be shared: the speedup is against the --jobs 1 row of the
same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROFILE_8B = "reports/fidelity/gen/l/profile-h100-llama3-8b-states.json"  # host_speed.states
KEYS = ("seed_spread", "host_band")


def run_cli(trace: str, sets: list[str], seeds: int, jobs: int, out: Path) -> tuple[float, dict]:
    """One `sim run` end to end: its wall seconds and summary.json."""
    cmd = [sys.executable, "-m", "sim", "run", trace, "-q", "-o", str(out),
           "--seeds", str(seeds), "--host-band", "--jobs", str(jobs)]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return wall, json.loads((out / "summary.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="traces/azure_conv.parquet")
    p.add_argument("--profile", default=PROFILE_8B, help="a profile with host_speed.states")
    p.add_argument("--set", dest="sets", action="append", default=None,
                   help="config overrides (default model=llama3-8b, gpu=h100)")  # fmt: skip
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--jobs", default="2,4", help="pool sizes to time after --jobs 1")
    p.add_argument("--write", "--json", dest="write", help="write the rows as JSON")
    args = p.parse_args()
    sets = [*(args.sets or ["model=llama3-8b", "gpu=h100"]), f"profile={args.profile}"]
    pools = [1, *(int(j) for j in args.jobs.split(",") if int(j) != 1)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-side-") as tmp:
        base: dict | None = None
        for jobs in pools:
            wall, summary = run_cli(args.trace, sets, args.seeds, jobs, Path(tmp) / f"j{jobs}")
            got = {k: summary[k] for k in KEYS}
            base = base or got
            rows.append({"jobs": jobs, "wall_s": wall, "same": got == base})
    first = rows[0]["wall_s"]
    for r in rows:
        r["speedup"] = first / r["wall_s"]
    runs = args.seeds + 2
    print(f"# python bench/side_runs.py {' '.join(sys.argv[1:])}".rstrip())
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cpu = platform.processor() or platform.machine()
    print(f"# {args.trace}, {' '.join(sets)}: {runs} runs (the main one, {args.seeds - 1} seeds, "
          f"the band's two); {os.cpu_count()} CPUs, {cpu}, Python {platform.python_version()}, "
          f"{when}")  # fmt: skip
    print(f"{'jobs':>4} {'wall_s':>8} {'speedup':>8} {'same':>5}")
    for r in rows:
        print(f"{r['jobs']:>4} {r['wall_s']:>8.2f} {r['speedup']:>7.2f}x {str(r['same']):>5}")
    if args.write:
        Path(args.write).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
