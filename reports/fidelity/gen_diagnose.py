"""The step-record numbers section 1 of the fidelity README cites (the generalization protocol,
H100, llama3.2-1b), from the committed measured runs and profile:

    python reports/fidelity/gen_diagnose.py [--runs DIR] [--profile FILE]

(defaults: reports/fidelity/gen/runs and gen/profile-h100-llama3.2-1b.json)

1. decode CUDA-graph steps by batch band (8 rows a band): median GPU ms of steps the GPU began
   after >= 100 us idle ("idle start") and of steps queued behind the previous one (< 10 us);
2. the host's wait for a step's tokens: median ms from the step's GPU end to the wait's end,
   over the steps whose host waited (sync_wait.wake_ms);
3. a depth-1 decode step's period (consecutive decode steps, medians): GPU interval, gap to the
   next step's GPU start, of which the token wait and the CPU phases;
4. the committed profile's decode pass on each run's clean, queued decode steps without
   penalties (the steps the sweep's samples stand for): median measured / predicted by band;
5. its mixed pass on each run's clean mixed steps (kernels alone): median measured / predicted;
6. speculative-decoding runs: the host phases `sample` and `draft` on steps without a prefill,
   median ms over the run and over each eighth of it (the host's level and its drift);
7. the host's level: median `sample` us on steps without a prefill (all, and 6-10 rows), the
   median (and p90) eager (mixed-step) launch and mixed-step GPU interval in ms, and `sample`'s
   median (4-12 rows) per 5 s window of the run;
8. decode graphs issued to an idle GPU: median ms saved against the profile's decode pass
   (predicted - measured) per idle gap, with the predicted median (the idle-start law);
9. speculative-decoding runs: the verify (+ GPU draft) interval by batch band, median ms and
   median measured / profile;
10. the GPU clock against the host's: the token wait's p10 (item 2) per sixth of the run, and
   its slope in us per s of run (a slope far from 0 is the GPU timer drifting against the
   host's clock: runs measured before the hooks' two-anchor mapping were mapped with one
   anchor; a run made since records the fitted rate, summary `replay.gpu_clock`);
11. arrivals that come together: how many of the run's inter-arrival gaps are under 10 us, and
   the steps with a prefill by how many requests they prefill (1, 2, 3, ...), which is where
   an idle loop's wake (profile key `intake.wake_ms`) shows: a predicted run folder reads the
   same, so a prediction's counts stand beside the measured run's;
12. item 4's steps by band: the decode model's tail term (`tail_keys`, sim.cost.splits: the
   keys the longest attention program walks past a mean-context row's, x the fitted ms a key)
   median ms, and measured / (profile - the tail term): how much of item 4's ratio the term
   holds.

The check runs' folders are not in the tree (their step records are 21 MB); restore them first:
`git restore --source=ca31aaf -- reports/fidelity/gen/runs reports/fidelity/gen/runs2
reports/fidelity/gen/repeats reports/tp/runs reports/tp/runs2`. The calibration runs stay.
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
from replay.analysis.steps import CLEAN_TOL_S, predicted_gpu_ms, run_config  # noqa: E402

IDLE_S = 100e-6
BANDS = ((1, 8), (8, 16), (16, 24), (24, 32), (32, 64), (64, 256))


def _decode(s: dict[str, np.ndarray]) -> np.ndarray:
    return (s["num_prefill_reqs"] == 0) & (s["draft_tokens"] == 0) & np.isfinite(s["gpu_start_s"])


def idle_vs_queued(s: dict[str, np.ndarray]) -> list[str]:
    ms = (s["gpu_end_s"] - s["gpu_start_s"]) * 1e3
    out = []
    for lo, hi in BANDS:
        band = _decode(s) & (s["num_reqs"] >= lo) & (s["num_reqs"] < hi)
        idle, queued = (
            band & (s["gpu_idle_before_s"] >= IDLE_S),
            band & (s["gpu_idle_before_s"] < CLEAN_TOL_S),
        )
        if idle.sum() >= 5 and queued.sum() >= 5:
            out.append(
                f"b{lo}-{hi - 1}: idle {np.median(ms[idle]):.3f} ({idle.sum()}) "
                f"queued {np.median(ms[queued]):.3f} ({queued.sum()})"
            )
    return out


def token_wait(s: dict[str, np.ndarray]) -> str:
    s0, s1, g1 = s["sync_start_s"], s["sync_end_s"], s["gpu_end_s"]
    waited = np.isfinite(s0) & np.isfinite(g1) & (s0 < g1) & (s1 >= g1)
    if not waited.any():
        return "no token waits"
    lat = (s1 - g1)[waited] * 1e3
    p10, p50, p90 = np.percentile(lat, [10, 50, 90])
    return f"{int(waited.sum())} waits: p10 {p10:.3f} p50 {p50:.3f} p90 {p90:.3f} ms"


def clock_drift(run, s: dict[str, np.ndarray]) -> str:  # noqa: ANN001
    s0, s1, g1 = s["sync_start_s"], s["sync_end_s"], s["gpu_end_s"]
    waited = np.isfinite(s0) & np.isfinite(g1) & (s0 < g1) & (s1 >= g1)
    if waited.sum() < 60:
        return "too few token waits"
    t, lat = g1[waited], (s1 - g1)[waited] * 1e3
    edges = np.linspace(t.min(), t.max(), 7)
    mid, p10 = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (t >= lo) & (t <= hi)
        if m.sum() >= 10:
            mid.append((lo + hi) / 2)
            p10.append(float(np.percentile(lat[m], 10)))
    slope = float(np.polyfit(mid, p10, 1)[0]) * 1e3 if len(mid) >= 3 else float("nan")
    rec = ((run.summary.get("replay") or {}).get("gpu_clock") or {}).get("drift_ppm")
    tail = f"; recorded rate: {rec:+.1f} ppm" if rec is not None else "; one-anchor run"
    return f"p10 ms {' '.join(f'{v:.3f}' for v in p10)}: slope {slope:+.1f} us/s{tail}"


def decode_by_band(s: dict[str, np.ndarray]) -> list[str]:
    ms = (s["gpu_end_s"] - s["gpu_start_s"]) * 1e3
    out = []
    for lo, hi in BANDS:
        band = _decode(s) & (s["num_reqs"] >= lo) & (s["num_reqs"] < hi)
        if band.sum() >= 5:
            out.append(f"b{lo}-{hi - 1}: {np.median(ms[band]):.3f} ({band.sum()})")
    return out


def mixed_clean(run, s: dict[str, np.ndarray], profile: dict) -> str:  # noqa: ANN001
    ends = np.fmax(s["sample_end_s"], s["launch_end_s"])
    rows = np.flatnonzero(
        (s["num_prefill_reqs"] > 0)
        & np.isfinite(s["gpu_start_s"])
        & (s["gpu_start_s"] >= ends - CLEAN_TOL_S)
    )
    if rows.size < 3:
        return f"{rows.size} clean mixed steps"
    meas = (s["gpu_end_s"][rows] - s["gpu_start_s"][rows]) * 1e3
    ratio = np.median(meas / predicted_gpu_ms(run, profile, s, rows))
    return f"{ratio:.3f} over {rows.size} clean mixed steps"


def depth1_period(s: dict[str, np.ndarray]) -> str:
    d = _decode(s)
    i = np.flatnonzero(d[:-1] & d[1:])
    g0, g1 = s["gpu_start_s"], s["gpu_end_s"]
    gap = (g0[i + 1] - g1[i]) * 1e3
    wait = (s["sync_end_s"][i] - g1[i]) * 1e3
    phases = (s["launch_end_s"][i + 1] - s["process_outputs_start_s"][i]) * 1e3

    def med(x: np.ndarray) -> float:
        return float(np.nanmedian(x))

    gpu = med((g1 - g0)[i] * 1e3)
    return (
        f"period {gpu + med(gap):.3f} = GPU {gpu:.3f} + gap {med(gap):.3f} "
        f"(token wait {med(wait):.3f}, process_outputs..launch {med(phases):.3f})"
    )


def clean_decode_bands(run, s: dict[str, np.ndarray], profile: dict):  # noqa: ANN001, ANN201
    """Per band of item 4 (at least 20 steps): (lo, hi, rows, measured ms, the profile's ms) of
    the clean queued decode steps without history rows (at most ~2000 a band, evenly taken)."""
    ends = np.fmax(s["sample_end_s"], s["launch_end_s"])
    ok = (
        _decode(s)
        & (s["history_tokens"] == 0)
        & (s["gpu_start_s"] >= ends - CLEAN_TOL_S)
        & (s["gpu_idle_before_s"] < CLEAN_TOL_S)
    )
    for lo, hi in BANDS:
        rows = np.flatnonzero(ok & (s["num_reqs"] >= lo) & (s["num_reqs"] < hi))
        if rows.size < 20:
            continue
        rows = rows[:: max(1, rows.size // 2000)]
        meas = (s["gpu_end_s"][rows] - s["gpu_start_s"][rows]) * 1e3
        yield lo, hi, rows, meas, predicted_gpu_ms(run, profile, s, rows)


def level_by_band(run, s: dict[str, np.ndarray], profile: dict) -> list[str]:  # noqa: ANN001
    return [
        f"b{lo}-{hi - 1}: {np.median(meas / pred):.3f} ({rows.size})"
        for lo, hi, rows, meas, pred in clean_decode_bands(run, s, profile)
    ]


def tail_coefficient(profile: dict) -> float:
    """The decode model's ms per `tail_keys` key (its branch that has one), else 0."""
    decode = (profile.get("gpu_pass") or {}).get("decode", {})
    branches = decode.get("max", [decode])
    return next((float(b["tail_keys"]) for b in branches if b.get("tail_keys")), 0.0)


def tail_by_band(run, s: dict[str, np.ndarray], profile: dict) -> list[str]:  # noqa: ANN001
    """Item 4's steps by band: the decode model's tail term (`tail_keys` x its coefficient,
    sim.cost.splits) median ms, and measured / (profile - the tail term)."""
    from bubblesim.core.models import get_model  # why lazy: only this item reads the model
    from sim.cost.splits import num_sms, tail_keys_fn

    cfg = run_config(run)
    coef = tail_coefficient(profile)
    sms = num_sms(cfg.gpu)
    if not coef or sms is None:
        return ["no tail term in the profile's decode model"]
    heads = get_model(cfg.model).kv_heads_per_rank(cfg.tensor_parallel_size)
    tail = tail_keys_fn(heads, sms)
    out = []
    for lo, hi, rows, meas, pred in clean_decode_bands(run, s, profile):
        cols = (s["num_reqs"][rows], s["kv_read_tokens"][rows], s["max_kv_tokens"][rows])
        ms = coef * np.array([tail(int(n), int(kv), int(mx)) for n, kv, mx in zip(*cols)])
        out.append(
            f"b{lo}-{hi - 1}: tail {np.median(ms):.3f} ms, without it "
            f"{np.median(meas / (pred - ms)):.3f} ({rows.size})"
        )
    return out


def host_level(s: dict[str, np.ndarray], phase: str) -> str:
    """Median ms of `phase` on steps without a prefill, whole run | each eighth of it."""
    ms = (s[f"{phase}_end_s"] - s[f"{phase}_start_s"]) * 1e3
    rows = np.flatnonzero((s["num_prefill_reqs"] == 0) & np.isfinite(ms))
    if not rows.size:
        return "no steps"
    eighths = " ".join(f"{np.median(ms[r]):.3f}" for r in np.array_split(rows, 8) if r.size)
    return f"{np.median(ms[rows]):.3f} | eighths {eighths}"


IDLE_BINS_MS = (0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0)
WINDOW_S = 5.0


def host_phases(s: dict[str, np.ndarray]) -> str:
    """Item 7: the host's level in this run."""
    dec = s["num_prefill_reqs"] == 0
    sample_us = (s["sample_end_s"] - s["sample_start_s"]) * 1e6
    launch_ms = (s["launch_end_s"] - s["launch_start_s"]) * 1e3
    gpu_ms = (s["gpu_end_s"] - s["gpu_start_s"]) * 1e3
    mid = dec & (s["num_reqs"] >= 6) & (s["num_reqs"] <= 10)
    small = dec & (s["num_reqs"] >= 4) & (s["num_reqs"] <= 12)
    t = s["sample_start_s"]
    windows = []
    for w0 in np.arange(0.0, float(np.nanmax(t)), WINDOW_S):
        w = small & (t >= w0) & (t < w0 + WINDOW_S) & np.isfinite(sample_us)
        windows.append(f"{np.median(sample_us[w]):.1f}" if w.sum() > 20 else "-")

    def med(x: np.ndarray, rows: np.ndarray, q: float = 50) -> str:
        ok = rows & np.isfinite(x)
        return f"{np.percentile(x[ok], q):.2f}" if ok.any() else "-"

    return (
        f"sample us {med(sample_us, dec)} (6-10 rows {med(sample_us, mid)}); "
        f"eager launch ms {med(launch_ms, ~dec)} (p90 {med(launch_ms, ~dec, 90)}), "
        f"mixed GPU ms {med(gpu_ms, ~dec)} (p90 {med(gpu_ms, ~dec, 90)}); "
        f"sample us per {WINDOW_S:.0f} s (4-12 rows): {' '.join(windows)}"
    )


def idle_saving(run, s: dict[str, np.ndarray], profile: dict) -> list[str]:  # noqa: ANN001
    """Item 8: ms saved by decode graphs issued to an idle GPU, by idle gap."""
    idle_ms = s["gpu_idle_before_s"] * 1e3
    rows = np.flatnonzero(_decode(s) & (idle_ms >= IDLE_BINS_MS[0]))
    if rows.size < 5:
        return []
    pred = predicted_gpu_ms(run, profile, s, rows)
    saved = pred - (s["gpu_end_s"][rows] - s["gpu_start_s"][rows]) * 1e3
    out = []
    for lo, hi in zip(IDLE_BINS_MS, (*IDLE_BINS_MS[1:], np.inf), strict=True):
        b = (idle_ms[rows] >= lo) & (idle_ms[rows] < hi)
        if b.sum() >= 5:
            out.append(
                f"{lo}-{hi}: {np.median(saved[b]):.2f} of {np.median(pred[b]):.2f} ({b.sum()})"
            )
    return out


def verify_by_band(run, s: dict[str, np.ndarray], profile: dict) -> list[str]:  # noqa: ANN001
    """Item 9: the verify (+ GPU draft) interval by batch band."""
    ms = (s["gpu_end_s"] - s["gpu_start_s"]) * 1e3
    v = (s["num_prefill_reqs"] == 0) & (s["draft_tokens"] > 0) & np.isfinite(ms)
    out = []
    for lo, hi in BANDS:
        rows = np.flatnonzero(v & (s["num_reqs"] >= lo) & (s["num_reqs"] < hi))
        if rows.size >= 20:
            ratio = np.median(ms[rows] / predicted_gpu_ms(run, profile, s, rows))
            out.append(f"b{lo}-{hi - 1}: {np.median(ms[rows]):.3f} ms, x{ratio:.3f} ({rows.size})")
    return out


def arrivals_together(run, s: dict[str, np.ndarray]) -> str:  # noqa: ANN001
    """Item 11: inter-arrival gaps under 10 us, and prefill steps by prefill requests."""
    gaps = np.diff(np.sort(run.arrays("requests")["arrival_s"]))
    pre = s["num_prefill_reqs"][s["prefill_tokens"] > 0]
    counts = np.bincount(pre)[1:] if pre.size else np.zeros(0, np.int64)
    by = " ".join(f"{k + 1}:{c}" for k, c in enumerate(counts.tolist()) if c)
    return (
        f"{int((gaps < 1e-5).sum())} of {gaps.size} gaps under 10 us; "
        f"{pre.size} prefill steps by prefill requests {by}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=ROOT / "reports/fidelity/gen/runs")
    ap.add_argument("--prefix", default="1b-", help="runs of one model (the profile's): 1b-, 8b-")
    ap.add_argument(
        "--profile", type=Path, default=ROOT / "reports/fidelity/gen/profile-h100-llama3.2-1b.json"
    )
    args = ap.parse_args()
    profile = json.loads(args.profile.read_text())
    for path in sorted(p for p in args.runs.iterdir() if (p / "summary.json").is_file()):
        if not path.name.startswith(args.prefix):
            continue
        run = load_run(path)
        s = run.arrays("steps")
        depth = run_config(run).depth  # batches actually in flight (1 with ngram-cpu)
        print(f"== {path.name} (depth {depth})")
        print("  1. decode graph GPU ms, idle start vs queued:", "; ".join(idle_vs_queued(s)))
        print("  2. token wait after GPU end:", token_wait(s))
        if depth == 1:
            print("  3. depth-1 decode step:", depth1_period(s))
            print("     decode GPU ms by band (each starts idle):", "; ".join(decode_by_band(s)))
        level = "; ".join(level_by_band(run, s, profile))
        print("  4. measured / profile, clean queued decode:", level)
        print("  5. measured / profile, mixed:", mixed_clean(run, s, profile))
        if run_config(run).spec.enabled:
            for phase in ("sample", "draft"):
                print(f"  6. host {phase} ms:", host_level(s, phase))
        print("  7. host:", host_phases(s))
        print(
            "  8. idle start, ms saved of predicted by idle ms:",
            "; ".join(idle_saving(run, s, profile)),
        )
        if run_config(run).spec.enabled:
            print("  9. verify interval:", "; ".join(verify_by_band(run, s, profile)))
        print(" 10. token wait p10 over the run:", clock_drift(run, s))
        print(" 11. arrivals together:", arrivals_together(run, s))
        print(
            " 12. decode tail term, clean queued decode:", "; ".join(tail_by_band(run, s, profile))
        )


if __name__ == "__main__":
    main()
