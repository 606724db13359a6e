"""The diagnostics reports/ablate.md cites, from the measured folders of `gpu_runs.sh seeds`
(unpacked) and the predicted runs of predict.sh:

    python reports/ablate/diagnose.py MEASURED [PREDICTED]   # default runs/ablate-predict

1. Every repeat in run order (off block, then on block): throughput, TPOT p50 and the host's
   pace, the mean schedule + process_outputs time per step (phases no seed switch touches).
2. Seed 5: steps whose CPU waited for the in-flight step's accepted counts (what the switch
   removes), the sides' median sample / draft phases and GPU interval, and where the GPU ends
   against the end of the host's draft phase (which issues the ngram-gpu proposer's kernels);
   the same for seed 4's on side (ngram-gpu on its own workload).
3. Seed 3 (one repeat a side): the placeholder scan's cost per history token by stretch of the
   run, and the elapsed-time change through each stretch, measured and predicted.

numpy + pyarrow, and bubblesim.core.runfmt.codec to decode the run files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bubblesim.core.runfmt import codec  # noqa: E402

SEEDS = {
    "seed4": ["spec_method"],
    "seed5": ["optimistic_spec_decode"],
    "seed5-8b": ["optimistic_spec_decode"],
    "seed12": ["preallocated_backup_tokens", "accepted_count_by_sum"],
    "seed3": ["reverse_placeholder_scan"],
}


def steps(run: Path) -> dict[str, np.ndarray]:
    t = codec.read_table(run / "steps.parquet")
    return {n: t.column(n).to_numpy(zero_copy_only=False) for n in t.column_names}


def phase_ms(s: dict[str, np.ndarray], p: str) -> np.ndarray:
    return (s[f"{p}_end_s"] - s[f"{p}_start_s"]) * 1e3


def repeats(measured: Path) -> None:
    print(
        "1. repeats in run order: tok/s, TPOT p50 (ms), host pace (schedule + process_outputs ms)"
    )
    for seed, switches in SEEDS.items():
        for sw in switches:
            for side in ("off", "on"):
                path = measured / seed / f"{sw}-{side}" / "summary.json"
                if not path.is_file():  # a partial set (one device call's seeds)
                    continue
                summ = json.loads(path.read_text())
                reps = (summ.get("repeats") or {}).get("metrics") or [None]
                cells = []
                for m in reps:
                    if m is None:  # one repeat: the run's own summary
                        tok, tpot = summ["output_tok_per_s"], summ["tpot_s"]["p50"]
                        cpu = summ["cpu_ms_mean"]
                        pace = cpu["schedule"] + cpu["process_outputs"]
                    else:
                        tok, tpot = m["output_tok_per_s"], m["tpot_s.p50"]
                        pace = m["cpu_ms_mean.schedule"] + m["cpu_ms_mean.process_outputs"]
                    cells.append(f"{tok:7.0f} {1e3 * tpot:5.2f} {pace:5.3f}")
                print(f"  {seed:6} {sw:26} {side:3} | " + " | ".join(cells))


def seed5(measured: Path) -> None:
    print("2. seed 5: accepted-count waits and the host phases (median ms, decode steps)")
    runs = [(d, "optimistic_spec_decode", x) for d in ("seed5", "seed5-8b") for x in ("off", "on")]
    runs.append(("seed4", "spec_method", "on"))  # ngram-gpu too, another workload
    for seed, switch, side in runs:
        if not (measured / seed / f"{switch}-{side}").is_dir():
            continue
        s = steps(measured / seed / f"{switch}-{side}")
        dec = s["num_prefill_reqs"] == 0
        waits = int((s["sync_count"][dec] > 0).sum())
        med = {
            p: float(np.median(phase_ms(s, p)[dec])) for p in ("prepare_inputs", "sample", "draft")
        }
        gpu = float(np.median(((s["gpu_end_s"] - s["gpu_start_s"]) * 1e3)[dec]))
        # where the GPU ends against the host's draft phase, which issues the GPU drafter
        lead = (s["gpu_end_s"] - s["draft_end_s"])[dec] * 1e3
        p10, p50, p90 = np.percentile(lead, [10, 50, 90])
        print(
            f"  {seed:8} {side:3}: {waits} of {int(dec.sum())} decode steps waited; "
            + ", ".join(f"{p} {v:.3f}" for p, v in med.items())
            + f", GPU interval {gpu:.3f}; GPU end - draft end p10/p50/p90 "
            + f"{p10:+.3f}/{p50:+.3f}/{p90:+.3f}"
        )


def seed3(measured: Path, predicted: Path) -> None:
    print("3. seed 3: scan ns per history token (median over the stretch), elapsed change")
    name = "reverse_placeholder_scan"
    if not (measured / "seed3" / f"{name}-off").is_dir():
        print("  (no seed3 runs)")
        return
    m = {side: steps(measured / "seed3" / f"{name}-{side}") for side in ("off", "on")}
    p = {side: steps(predicted / "seed3" / f"{name}-{side}.sim") for side in ("off", "on")}

    def elapsed(s: dict[str, np.ndarray], i: int) -> float:
        return float(s["schedule_start_s"][i] - s["schedule_start_s"][0])

    n = len(m["off"]["step"])
    hist = m["off"]["history_tokens"].astype(float)
    ns = np.where(hist > 0, phase_ms(m["off"], "sample") * 1e6 / np.maximum(hist, 1), np.nan)
    for lo in range(0, n, 500):
        hi = min(lo + 500, n - 1)
        scan = float(np.nanmedian(ns[lo:hi]))
        mc = elapsed(m["on"], hi) / elapsed(m["off"], hi) - 1
        pc = elapsed(p["on"], hi) / elapsed(p["off"], hi) - 1
        print(
            f"  steps {lo:4}-{hi:4}: scan {scan:5.1f} ns/token | through step {hi}: off "
            f"{elapsed(m['off'], hi):5.1f} s measured, {elapsed(p['off'], hi):5.1f} predicted; "
            f"change {100 * mc:+5.1f} % measured, {100 * pc:+5.1f} % predicted"
        )


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    measured = Path(argv[0])
    predicted = Path(argv[1]) if len(argv) > 1 else Path("runs/ablate-predict")
    repeats(measured)
    seed5(measured)
    seed3(measured, predicted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
