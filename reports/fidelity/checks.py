"""Predict measured check runs with ONE committed profile and compare (the generalization
protocol of reports/fidelity/README.md: the profile never saw these workloads).

    python reports/fidelity/checks.py PROFILE RUNS_DIR --gpu h100 [--prefix 1b-] [--tag T] [--out D]

RUNS_DIR holds measured run folders named `<model tag>-<check>` (reports/fidelity/gpu_checks.sh);
each is predicted by `sim run` on its own trace (summary.json trace.path) with the measured
run's own config (KV budget, depth, spec decoding, arrival mode) plus PROFILE, compared with
`replay compare`, and judged against the targets. Writes D/<gpu>-<run>[-T].json and
D/<gpu>-checks[-<model tag>][-T].md (a table with verdicts); the calibration runs (`*-calib*`)
are listed as such, not as a check. --prefix keeps the runs of one model (their name's start).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from replay.analysis.probe import host_scale  # noqa: E402

# (metric key in fidelity.json, column, target: |rel error| <= x, or |points| <= x for bubbles)
TARGETS = [
    ("output_tok_per_s", "tok/s", 0.03),
    ("tpot_s.p50", "TPOT p50", 0.05),
    ("tpot_s.p99", "TPOT p99", 0.10),
    ("ttft_s.p50", "TTFT p50", 0.10),
    ("e2e_s.p50", "e2e p50", 0.05),
    ("bubble_fraction", "bubble", 2.0),
    ("gpu_ms_mean", "GPU ms/step", None),
]
CONFIG_KEYS = ["model", "num_kv_blocks", "batches_in_flight", "max_num_seqs", "cuda_graphs",
               "max_num_batched_tokens", "block_size", "chunked_prefill", "prefix_caching",
               "gc_freeze", "optimistic_spec_decode", "preallocated_backup_tokens",
               "accepted_count_by_sum", "reverse_placeholder_scan", "arrival",
               "cuda_graphs_mixed", "tensor_parallel_size", "tp_allreduce"]  # fmt: skip


def sh(*args: str) -> None:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)} failed:\n{r.stderr[-2000:]}")


def sim_sets(cfg: dict, profile: Path, gpu: str, seed: int = 0) -> list[str]:
    sets = [f"{k}={cfg[k]}" for k in CONFIG_KEYS if k in cfg]
    sets += [f"spec.{k}={v}" for k, v in cfg["spec"].items()]
    sets += [f"sampling.{k}={v}" for k, v in cfg["sampling"].items()]
    sets += [f"gpu={gpu}", f"profile={profile}", f"seed={seed}"]
    return [x for s in sets for x in ("--set", s)]


def error(metrics: dict, key: str) -> float | None:
    """A comparison's error on `key` as the tables read it: % for rates and latencies, points
    for the bubble fraction; None where the comparison has none."""
    m = metrics.get(key, {})
    if key == "bubble_fraction":
        e = m.get("abs_error_points")
        return None if e is None else float(e)
    e = m.get("rel_error")
    return None if e is None else 100 * float(e)


def within(key: str, err: float, target: float | None) -> bool:
    """`err` (as `error` gives it) within a TARGETS target (a fraction; points for the bubble)."""
    if target is None:
        return False
    return abs(err) <= (target if key == "bubble_fraction" else 100 * target)


def cell(data: dict, key: str, target: float | None) -> str:
    m = data["metrics"].get(key, {})
    if key == "bubble_fraction":
        e = m.get("abs_error_points")
        if e is None:
            return "-"
        return f"**{e:+.2f} pt**" if target is not None and abs(e) <= target else f"{e:+.2f} pt"
    e = m.get("rel_error")
    if e is None:
        return "-"
    ok = target is not None and abs(e) <= target
    return f"**{100 * e:+.1f} %**" if ok else f"{100 * e:+.1f} %"


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The arguments naming the profile, the measured runs and where predictions go (this
    script's and host_level.py's)."""
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", type=Path)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--tag", default="", help="a suffix naming this set's outputs")
    ap.add_argument(
        "--prefix", default="",
        help="only the run folders whose name starts with this (the model tag, e.g. 8b-)",
    )  # fmt: skip
    ap.add_argument(
        "--work", type=Path, default=ROOT / "runs" / "checks-work",
        help="where the predicted runs and comparisons go (not the measured runs' folder)",
    )  # fmt: skip


def measured_runs(runs: Path, prefix: str) -> list[tuple[Path, dict]]:
    """(folder, summary) of the replayed runs in `runs` whose name starts with `prefix`."""
    out = []
    for meas in sorted(p for p in runs.iterdir() if (p / "summary.json").is_file()):
        if not meas.name.startswith(prefix):
            continue
        summary = json.loads((meas / "summary.json").read_text())
        if summary["source"]["kind"] == "replay":
            out.append((meas, summary))
    return out


def predict_and_compare(
    meas: Path, summary: dict, profile: Path, gpu: str, work: Path, name: str, seed: int = 0,
    extra_sets: tuple[str, ...] = (),
) -> dict:  # fmt: skip
    """`sim run` on the measured run's trace and config (+ `--set extra_sets`), then `replay
    compare` against it: the comparison (fidelity.json), kept under `work` as sim-/fid-`name`."""
    pred = work / f"sim-{name}"
    sets = [x for s in extra_sets for x in ("--set", s)]
    sh("-m", "sim", "run", str(ROOT / summary["trace"]["path"]), "-q", "--force", "-o",
       str(pred), *sim_sets(summary["config"], profile, gpu, seed), *sets)  # fmt: skip
    fid = work / f"fid-{name}"
    sh("-m", "replay", "compare", str(pred), str(meas), "--force", "-o", str(fid))
    return json.loads((fid / "fidelity.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument(
        "--seed", type=int, default=0, help="the simulator's seed; 0 made the committed tables"
    )
    ap.add_argument(
        "--probe", action="store_true",
        help="predict each run at its host probe's level (host_scale = the probe's level over "
        "the profile's host_probe level; replay.analysis.probe): read before the run, not from it",
    )  # fmt: skip
    args = ap.parse_args()
    sfx = f"-{args.tag}" if args.tag else ""
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for meas, summary in measured_runs(args.runs, args.prefix):
        scale = host_scale(meas, args.profile) if args.probe else None
        sets = (f"host_scale={scale!r}",) if scale is not None else ()
        data = predict_and_compare(
            meas, summary, args.profile, args.gpu, args.work, f"{meas.name}{sfx}", args.seed, sets
        )
        data["role"] = "calibration" if "-calib" in meas.name else "check"
        data["profile"] = str(args.profile)
        if scale is not None:
            data["host_scale"] = scale
        (args.out / f"{args.gpu}-{meas.name}{sfx}.json").write_text(json.dumps(data, indent=1))
        rows.append((meas.name, data))
    head = "| run | role | " + " | ".join(c for _, c, _ in TARGETS) + " |"
    table = [head, "|---" * (len(TARGETS) + 2) + "|"]
    for name, data in rows:
        cells = [cell(data, k, t) for k, _, t in TARGETS]
        table.append(f"| {name} | {data['role']} | " + " | ".join(cells) + " |")
    checks = [d for _, d in rows if d["role"] == "check"]
    for key, col, target in TARGETS:
        if target is None:
            continue
        met = sum(1 for d in checks if cell(d, key, target).startswith("**"))
        table.append(f"\n{col}: {met}/{len(checks)} checks within target")
    text = "\n".join(table) + "\n"
    model = f"-{args.prefix.rstrip('-')}" if args.prefix else ""
    (args.out / f"{args.gpu}-checks{model}{sfx}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
