"""One profile's predictions of measured runs over several simulator seeds: how much of an error
is the seed's draw (host_speed's slow process has a few independent stretches per run).

    python reports/tp/seed_sweep.py PROFILE RUNS_DIR --prefix 8b-tp2- [--seeds 4] [--tag T]
        [--out DIR]

Runs reports/fidelity/checks.py once per seed 0 .. N-1 (tag `T-s<seed>`, outputs under DIR;
predicted folders under runs/checks-work/sim-<run>-T-s<seed>), then prints per run the mean
[min, max] over the seeds of the relative errors of tok/s, TPOT p50/p99, TTFT p50, e2e p50,
and the predicted eager (mixed-step) launch median in ms beside the measured one; last, how many
checks (runs not named *-calib*) are within each target of reports/fidelity/checks.py on the mean
over the seeds (the bubble fraction's error in points).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "reports" / "fidelity"))

from checks import TARGETS, error, within  # noqa: E402

from bubblesim.core.runfmt import load_run  # noqa: E402

KEYS = ("output_tok_per_s", "tpot_s.p50", "tpot_s.p99", "ttft_s.p50", "e2e_s.p50",
        "bubble_fraction")  # fmt: skip


def within_counts(means: dict[str, list[float]]) -> str:
    """Per KEYS target, how many of the runs' mean errors are within it."""
    limit = {k: t for k, _, t in TARGETS}
    cells = []
    for i, k in enumerate(KEYS):
        n = sum(within(k, m[i], limit[k]) for m in means.values())
        cells.append(f"{k} {n}/{len(means)}")
    return ", ".join(cells)


def eager_launch_p50_ms(path: Path) -> float:
    """Median launch ms of a run's steps with a prefill (eager unless cuda_graphs_mixed)."""
    s = load_run(path).arrays("steps")
    mixed = np.asarray(s["num_prefill_reqs"]) > 0
    ms = (np.asarray(s["launch_end_s"]) - np.asarray(s["launch_start_s"])) * 1e3
    ok = mixed & np.isfinite(ms)
    return float(np.median(ms[ok])) if ok.any() else float("nan")


def span(x: list[float], fmt: str) -> str:
    return f"{np.mean(x):{fmt}} [{min(x):{fmt}}, {max(x):{fmt}}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", type=Path)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--tag", default="seeds")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--out", type=Path, default=Path("/tmp/seed_sweep"))
    ap.add_argument(
        "--reuse", action="store_true",
        help="only print: read the comparisons an earlier sweep with the same --tag left in --out",
    )  # fmt: skip
    args = ap.parse_args()
    if args.seeds < 1:
        raise SystemExit(f"--seeds: expected >= 1, got {args.seeds}")
    for seed in range(0 if args.reuse else args.seeds):
        cmd = [sys.executable, str(ROOT / "reports/fidelity/checks.py"), str(args.profile),
               str(args.runs), "--gpu", args.gpu, "--prefix", args.prefix, "--seed", str(seed),
               "--tag", f"{args.tag}-s{seed}", "--out", str(args.out)]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    print(f"run | {' | '.join(KEYS)} (% error, bubble in points; mean [min, max] over "
          f"{args.seeds} seeds) | eager launch p50 ms predicted | measured")  # fmt: skip
    means: dict[str, list[float]] = {}
    for meas in sorted(p for p in args.runs.iterdir() if p.name.startswith(args.prefix)):
        errs: list[list[float]] = [[] for _ in KEYS]
        launch = []
        for seed in range(args.seeds):
            tag = f"{args.tag}-s{seed}"
            f = args.out / f"{args.gpu}-{meas.name}-{tag}.json"
            if not f.is_file():
                continue
            metrics = json.loads(f.read_text())["metrics"]
            for e, k in zip(errs, KEYS, strict=True):
                e.append(error(metrics, k))
            launch.append(eager_launch_p50_ms(ROOT / "runs/checks-work" / f"sim-{meas.name}-{tag}"))
        if not launch:
            continue
        cells = " | ".join(span(e, "+.1f") for e in errs)
        print(f"{meas.name} | {cells} | {span(launch, '.1f')} | {eager_launch_p50_ms(meas):.1f}")
        if "-calib" not in meas.name:
            means[meas.name] = [float(np.mean(e)) for e in errs]
    print(f"within target on the mean over the seeds, {len(means)} checks: {within_counts(means)}")


if __name__ == "__main__":
    main()
