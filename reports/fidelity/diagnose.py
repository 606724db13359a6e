"""The step-record numbers the fidelity README cites, from the measured and predicted runs.

    python reports/fidelity/diagnose.py RUNS_DIR [--gpu h200] [--tag c]

RUNS_DIR as for analyze.py, after it ran (it holds `sim-<run>` beside each measured run and the
profiles are in reports/fidelity/profiles/). Prints, per run:
1. the eager launch of mixed (prefill) steps: mean and median ms (TTFT's largest part);
2. a decode step's period split into GPU interval and the host's time around it (median ms):
   period between schedule starts, GPU interval, GPU idle before the step, CPU phases, sync;
   and the decode GPU interval by batch-size band (for the depth-1 vs depth-2 comparison);
3. the decode GPU pass of the run's profile on its own kernel-only decode steps: mean error by
   band of the longest context (max_kv_tokens), for the profile as committed and for its bulk
   (KV stream) branch alone when the profile has the max form.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.runfmt import codec, load_run  # noqa: E402
from replay.analysis.steps import eval_linear, load_steps  # noqa: E402

MODELS = {"1b": "llama3.2-1b", "8b": "llama3-8b"}
PHASES = ("schedule", "prepare_inputs", "launch", "sample", "process_outputs")


def cols(run: Path) -> dict[str, np.ndarray]:
    t = codec.read_table(run / "steps.parquet")
    return {n: t.column(n).to_numpy(zero_copy_only=False) for n in t.column_names}


def ms(s: dict[str, np.ndarray], name: str) -> np.ndarray:
    return (s[f"{name}_end_s"] - s[f"{name}_start_s"]) * 1e3


def launch_line(s: dict[str, np.ndarray]) -> str:
    mixed = s["num_prefill_reqs"] > 0
    la = ms(s, "launch")[mixed]
    return f"mixed launch mean {la.mean():6.2f} median {np.median(la):6.2f} ms (n={mixed.sum()})"


def period_line(s: dict[str, np.ndarray]) -> str:
    dec = s["num_prefill_reqs"] == 0
    both = dec[1:] & dec[:-1]  # a decode step after a decode step
    period = np.diff(s["schedule_start_s"]) * 1e3
    gpu = ms(s, "gpu")
    idle = (s["gpu_start_s"][1:] - s["gpu_end_s"][:-1]) * 1e3
    cpu = sum(ms(s, p) for p in PHASES)
    sync = ms(s, "sync")
    out = (
        f"decode period {np.median(period[both]):.3f} = GPU {np.median(gpu[1:][both]):.3f}"
        f" + idle {np.median(idle[both]):.3f}; CPU phases {np.median(cpu[1:][both]):.3f},"
        f" sync {np.nanmedian(sync[1:][both]):.3f} |"
    )
    reqs = s["num_reqs"]
    for lo, hi in ((1, 4), (4, 8), (8, 12), (12, 20)):
        k = dec & (reqs >= lo) & (reqs < hi)
        if k.any():
            out += f" {lo}-{hi} reqs GPU {np.median(gpu[k]):.3f}"
    return out


def straggler_lines(run: Path, profile: dict) -> list[str]:
    steps = load_steps([load_run(run)])
    dec = (steps.cols["num_prefill_reqs"] == 0) & steps.clean & np.isfinite(steps.gpu_ms)
    if dec.sum() < 3:
        return []
    model = profile["gpu_pass"].get("decode")
    if model is None:
        return []
    forms = {"profile": model}
    if "max" in model:
        forms["bulk only"] = model["max"][0]
    y = steps.gpu_ms[dec]
    mk = steps.cols["max_kv_tokens"][dec]
    out = []
    for name, m in forms.items():
        pred = eval_linear(m, steps.cols, dec)
        cells = [f"all {100 * (pred.mean() / y.mean() - 1):+.1f} %"]
        for lo, hi in ((0, 8192), (8192, 16384), (16384, 32768), (32768, 1 << 40)):
            k = (mk >= lo) & (mk < hi)
            if k.sum() >= 20:
                err = 100 * (pred[k].mean() / y[k].mean() - 1)
                cells.append(f"{lo // 1024}k+ {err:+.1f} % (n={k.sum()})")
        out.append(f"    decode GPU error, {name}: " + ", ".join(cells))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    sfx = f"-{args.tag}" if args.tag else ""
    prof_dir = Path(__file__).resolve().parent / "profiles"
    for run in sorted(p for p in args.runs.iterdir() if (p / "steps.parquet").is_file()):
        tag = run.name.split("-")[0]
        if tag not in MODELS:
            continue  # sim-*, fid-*
        s = cols(run)
        print(f"{run.name}: {launch_line(s)}")
        print(f"    {period_line(s)}")
        sim = args.runs / f"sim-{run.name}"
        if (sim / "steps.parquet").is_file():
            print(f"    predicted: {period_line(cols(sim))}")
        prof = prof_dir / f"{args.gpu}-{MODELS[tag]}{sfx}.json"
        if prof.is_file():
            for line in straggler_lines(run, json.loads(prof.read_text())):
                print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
