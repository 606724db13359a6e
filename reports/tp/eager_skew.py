"""Why a profile with `host_speed` predicts the eager launch's median at its mean: the numbers.

    python reports/tp/eager_skew.py PROFILE RUN [--no-host-profile OUT]

PROFILE: a calibrated profile with `cpu_spread` and `host_speed` (replay calibrate); RUN: the
measured run it was calibrated on. Prints, for the `launch` phase:

1. how the spread fit (replay.analysis.spread, weights = predicted ms) splits between the eager
   launches and the graph replays (the weight share of the eager steps);
2. the eager steps' measured / predicted launch: quantiles, the top-level `cpu_spread.launch`
   table (the marginal over all steps) and `host_speed.cpu_spread.launch` (the spread around the
   host's speed, what the simulator draws while `host_speed` is on), at p10 / p50 / p90;
3. the host speed estimate calibrate divides by (replay.analysis.hostspeed.fit_host_speed): its
   correlation with the eager steps' own ratio, and with the mean log speed of the non-eager
   steps within 0.25 s of them (the host's state without the step itself);
4. the eager ratio's histogram (0.1 wide) and, per 2 s of the run, the eager steps' median ratio
   beside the decode steps' median ratio of each other CPU phase: the host's regimes.

`--no-host-profile OUT` writes PROFILE without `host_speed` (the simulator then draws every phase
from the top-level `cpu_spread`), for `reports/fidelity/checks.py OUT ...`. Pure numpy.
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
from replay.analysis.hostspeed import fit_host_speed, step_log_speeds  # noqa: E402
from replay.analysis.quality import phase_predicted_ms  # noqa: E402
from replay.analysis.steps import load_steps  # noqa: E402
from sim.cost.profile import resolve_profile  # noqa: E402

P = (0.1, 0.5, 0.9)
NEAR_S = 0.25  # item 3: the non-eager steps this close to an eager one
WINDOW_S = 2.0  # item 4
PHASES = ("schedule", "prepare_inputs", "sample", "process_outputs")


def ratios(res: dict, runs: list, steps, phase: str) -> np.ndarray:  # noqa: ANN001
    """Measured / predicted ms of `phase` per step (NaN where not measured)."""
    y = steps.phase_ms[phase]
    rows = np.isfinite(y)
    pred = np.full(len(steps), np.nan)
    pred[rows] = phase_predicted_ms(res, runs, steps, phase, rows)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(pred > 0, y / pred, np.nan)


def table_at(table: dict, ps: tuple[float, ...] = P) -> str:
    return " ".join(f"{np.interp(p, table['p'], table['ratio']):.3f}" for p in ps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("run", type=Path)
    ap.add_argument("--no-host-profile", type=Path, help="write PROFILE less host_speed here")
    args = ap.parse_args()
    prof = json.loads(args.profile.read_text())
    if "host_speed" not in prof or "launch" not in prof.get("cpu_spread", {}):
        raise SystemExit(f"{args.profile}: no host_speed or cpu_spread.launch to examine")
    runs = [load_run(args.run)]
    steps = load_steps(runs)
    # the predictions calibrate fits the spread and the speed on (neither key changes them)
    res = resolve_profile({k: v for k, v in prof.items() if k not in ("cpu_spread", "host_speed")})
    y = steps.phase_ms["launch"]
    pred = np.full(len(steps), np.nan)
    ok = np.isfinite(y)
    pred[ok] = phase_predicted_ms(res, runs, steps, "launch", ok)
    r = ratios(res, runs, steps, "launch")
    eager = np.isfinite(r) & ~steps.graph
    graph = np.isfinite(r) & steps.graph
    share = pred[eager].sum() / (pred[eager].sum() + pred[graph].sum())
    print(f"1. launch: {int(eager.sum())} eager steps (predicted {np.median(pred[eager]):.2f} ms), "
          f"{int(graph.sum())} graph replays ({np.median(pred[graph]):.3f} ms); the eager "
          f"steps' share of the spread fit's weight: {100 * share:.1f} %")  # fmt: skip
    q = " ".join(f"{x:.3f}" for x in np.quantile(r[eager], P))
    meas = y[eager]
    print(f"2. eager measured/predicted p10 p50 p90: {q} (measured ms p50 "
          f"{np.median(meas):.2f}, mean {meas.mean():.2f}, p90 {np.percentile(meas, 90):.2f}); "
          f"cpu_spread.launch {table_at(prof['cpu_spread']['launch'])}; host_speed.cpu_spread."
          f"launch {table_at(prof['host_speed']['cpu_spread']['launch'])}")  # fmt: skip
    notes: list[str] = []
    fit, speed, report = fit_host_speed(res, runs, steps, notes)
    e = np.flatnonzero(eager)
    corr = np.corrcoef(np.log(speed[e]), np.log(r[e]))[0, 1]
    series = step_log_speeds(res, runs, steps)[0]
    others = ~eager[series.rows]
    t = runs[0].arrays("steps")["schedule_start_s"]
    t_s = np.asarray(t, np.float64) - float(t[0])
    near = np.full(e.size, np.nan)
    for j, i in enumerate(e):
        m = others & (np.abs(series.t_s - t_s[i]) < NEAR_S)
        if m.sum() >= 3:
            near[j] = series.log_speed[m].mean()
    has = np.isfinite(near)
    corr_near = np.corrcoef(near[has], np.log(r[e][has]))[0, 1]
    resid = " ".join(f"{x:.3f}" for x in np.quantile(r[e] / speed[e], P))
    print(f"3. host_speed {fit}: corr(log speed estimate, log eager ratio) {corr:.2f}; "
          f"eager ratio / estimate p10 p50 p90 {resid}; corr with the other steps within "
          f"{NEAR_S} s {corr_near:.2f} ({int(has.sum())} eager steps)")  # fmt: skip
    edges = np.round(np.arange(0.4, 2.15, 0.1), 1)
    hist, _ = np.histogram(r[e], bins=edges)
    print("4. eager ratio histogram:", " ".join(f"{a:.1f}:{n}" for a, n in zip(edges, hist)))
    decode = steps.cols["num_prefill_reqs"] == 0
    other = {p: ratios(res, runs, steps, p) for p in PHASES}
    print(
        f"   per {WINDOW_S:.0f} s: start_s eager_n eager_median | decode median " + " ".join(PHASES)
    )
    for w0 in np.arange(0.0, float(t_s.max()), WINDOW_S):
        w = (t_s >= w0) & (t_s < w0 + WINDOW_S)
        ew = w & eager
        em = f"{np.median(r[ew]):5.2f}" if ew.any() else "    -"
        dm = " ".join(f"{np.nanmedian(other[p][w & decode]):5.2f}" for p in PHASES)
        print(f"   {w0:5.0f} {int(ew.sum()):4d} {em} | {dm}")
    if args.no_host_profile:
        out = {k: v for k, v in prof.items() if k != "host_speed"}
        args.no_host_profile.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.no_host_profile} (no host_speed)")


if __name__ == "__main__":
    main()
