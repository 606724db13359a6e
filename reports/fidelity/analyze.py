"""Calibrate on some measured runs, predict others with the simulator, compare.

    python reports/fidelity/analyze.py RUNS_DIR [--gpu h200] [--tag TAG] [--no-shapes]

RUNS_DIR holds measured run folders named `<model>-<workload>[-variant]` (from
reports/fidelity/gpu_runs.sh). For each model, the runs listed in CALIBRATE fit a cost profile
(`reports/fidelity/profiles/<gpu>-<model>.json`); every run is then predicted by `sim run` with
the measured run's own config (same KV budget, depth, switches) plus that profile, and compared
with `replay compare`. A clean-GPU shape sweep `RUNS_DIR/shapes-<model tag>.parquet` (`replay
shapes`), if present, joins the calibration's GPU fits (`--no-shapes`: runs only).
Writes reports/fidelity/<gpu>-<run>.json and the tables (which runs were calibration and which
were checks). With --tag TAG (e.g. an engine commit, for runs made on another engine version)
every output name gets `-TAG` appended (profiles, per-run JSONs, measured/<run>-TAG/, the
table), so two folders with the same run names can be analysed side by side, each with a
profile calibrated on its own engine version.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODELS = {"1b": "llama3.2-1b", "8b": "llama3-8b"}
# Calibration workloads per model: the rest of the runs are out-of-sample checks.
CALIBRATE = {"1b": ["azure45x4"], "8b": ["azure45x4"]}
TRACES = ROOT / "traces" / "fidelity"
KEYS = ["output_tok_per_s", "tpot_s.p50", "tpot_s.p99", "ttft_s.p50", "ttft_s.p99", "e2e_s.p50",
        "bubble_fraction", "gpu_ms_mean"]  # fmt: skip


def sh(*args: str) -> None:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)} failed:\n{r.stderr[-2000:]}")


def workload_of(run: str) -> str:
    parts = run.split("-")
    return parts[1] if len(parts) > 1 else run


def sim_sets(measured: Path, profile: Path, gpu: str) -> list[str]:
    cfg = json.loads((measured / "summary.json").read_text())["config"]
    keep = ["model", "num_kv_blocks", "batches_in_flight", "max_num_seqs", "cuda_graphs",
            "max_num_batched_tokens", "block_size", "chunked_prefill", "prefix_caching",
            "gc_freeze", "optimistic_spec_decode", "preallocated_backup_tokens",
            "accepted_count_by_sum", "reverse_placeholder_scan"]  # fmt: skip
    sets = [f"{k}={cfg[k]}" for k in keep]
    sets += [f"spec.{k}={v}" for k, v in cfg["spec"].items()]
    sets += [f"gpu={gpu}", f"profile={profile}"]
    return [x for s in sets for x in ("--set", s)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", type=Path)
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--tag", default="", help="suffix for every output name (engine version)")
    ap.add_argument("--no-shapes", action="store_true", help="ignore RUNS/shapes-<model>.parquet")
    args = ap.parse_args()
    sfx = f"-{args.tag}" if args.tag else ""
    runs = sorted(
        p
        for p in args.runs.iterdir()
        if (p / "summary.json").is_file()
        and json.loads((p / "summary.json").read_text())["source"]["kind"] == "replay"
        and json.loads((p / "summary.json").read_text()).get("complete", True)
    )  # measured, complete runs only (the 30 s A/B diagnostics are partial)
    keep = HERE / "measured"
    for r in runs:  # the measured summaries behind every table row, for the record
        (keep / f"{r.name}{sfx}").mkdir(parents=True, exist_ok=True)
        (keep / f"{r.name}{sfx}" / "summary.json").write_text((r / "summary.json").read_text())
    profiles = HERE / "profiles"
    profiles.mkdir(exist_ok=True)
    rows = []
    for tag, model in MODELS.items():
        mine = [r for r in runs if r.name.startswith(f"{tag}-")]
        if not mine:
            continue
        calib = [r for r in mine if r.name in {f"{tag}-{w}" for w in CALIBRATE[tag]}]
        prof = profiles / f"{args.gpu}-{model}{sfx}.json"
        sweep = args.runs / f"shapes-{tag}.parquet"  # clean GPU timings (gpu_runs.sh c1b/c8b)
        shapes = ["--shapes", str(sweep)] if sweep.is_file() and not args.no_shapes else []
        sh("-m", "replay", "calibrate", *map(str, calib), *shapes, "-o", str(prof))
        for meas in mine:
            trace = TRACES / f"{workload_of(meas.name)}.parquet"
            pred = args.runs / f"sim-{meas.name}"
            sh("-m", "sim", "run", str(trace), "-q", "-o", str(pred),
               *sim_sets(meas, prof, args.gpu))  # fmt: skip
            fid = args.runs / f"fid-{meas.name}"
            sh("-m", "replay", "compare", str(pred), str(meas), "-o", str(fid))
            data = json.loads((fid / "fidelity.json").read_text())
            out = HERE / f"{args.gpu}-{meas.name}{sfx}.json"
            data["role"] = "calibration" if meas in calib else "check"
            out.write_text(json.dumps(data, indent=1) + "\n")
            rows.append((meas.name, data))
    table = ["| run | role | " + " | ".join(KEYS) + " |", "|---" * (len(KEYS) + 2) + "|"]
    for name, data in rows:
        cells = []
        for k in KEYS:
            m = data["metrics"].get(k, {})
            if k in ("bubble_fraction",):
                e = m.get("abs_error_points")
                cells.append("-" if e is None else f"{e:+.2f} pt")
            else:
                e = m.get("rel_error")
                cells.append("-" if e is None else f"{100 * e:+.1f} %")
        table.append(f"| {name} | {data['role']} | " + " | ".join(cells) + " |")
    (HERE / f"{args.gpu}-table{sfx}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
