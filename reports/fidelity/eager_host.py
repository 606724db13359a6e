"""The eager launch against the host's speed around it: a floor, or all of it scaled (section L).

    python reports/fidelity/eager_host.py PROFILE RUN [RUN ...]

Section K proposed an eager launch made of a floor the host's speed does not scale plus an
excess it does, from the launches' 10th percentile moving less than their median between hosts.
This reads that law off each run directly. Per eager launch, the host's speed around it is
estimated from the OTHER CPU phases of the graphed steps within WINDOW_S before it and within
WINDOW_S after it (log measured / PROFILE's predicted, replay.analysis.hostspeed, the launch
phase left out, so the launch's own noise is not in its regressor). The elasticity
d log(launch) / d log(speed) is then the IV estimate: the log launch on the estimate before it,
instrumented by the one after (the same host state, independent noise), which the estimate's
noise does not attenuate as it does OLS. The windows still reach the host a little away from the
launch, which reads above 1 for a launch the speed scales whole (tests/test_report_eager_host.py:
a simulated run), so the same estimator runs on the graphed steps' own log speeds (elasticity 1 by
construction: their speed is the host's) at their own times, and the launch's elasticity is
read relative to theirs. Per run it prints:
- n: eager launches with at least MIN_SIDE_STEPS graphed steps on each side;
- speed: the median of exp(the two-sided estimate) (the run's host against the profile's);
- launch/speed: the median launch over that estimate (ms at the profile's speed 1);
- OLS (on the two-sided estimate, attenuated), IV, and ref: the IV of the graphed steps;
- rel = IV / ref, with its 5-95 % interval over BOOT resamples of the launches;
- the within-run slope of launch/speed on the step's requests (ms per request).
A launch the host's speed scales as it scales the other phases has rel 1. A floor F under an
excess E x speed has rel E s / (F + E s) at speed s: the excess's share. The last line pools the
runs' rel, weighted by n.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.phases import CPU_PHASES, LAUNCH  # noqa: E402
from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.hostspeed import step_log_speeds  # noqa: E402
from replay.analysis.steps import load_steps  # noqa: E402
from sim.cost.profile import load_profile, resolve_profile  # noqa: E402

WINDOW_S = 0.1  # each side's window: shorter than the host's slow process (tau 0.2-6 s)
MIN_SIDE_STEPS = 3  # graphed steps needed on each side of a launch
MIN_LAUNCHES = 30  # fewer such launches: no elasticity (an IV of a handful is noise)
BOOT = 200  # bootstrap resamples of the launches for the IV's interval (seeded)
OTHER_PHASES = tuple(p for p in CPU_PHASES if p != LAUNCH)


@dataclass
class EagerHost:
    """One run's eager launches beside the host's speed around them."""

    n: int
    speed: float  # median of exp(two-sided log speed)
    launch_per_speed_ms: float  # median launch / speed
    ols: float  # elasticity on the two-sided estimate
    iv: float  # elasticity, before-window estimate instrumented by the after-window one
    ref: float  # the same IV on the graphed steps' own log speeds (elasticity 1 in truth)
    rel: float  # iv / ref
    rel_lo: float  # rel's 5th and 95th percentiles over BOOT resamples of the launches
    rel_hi: float
    ms_per_req: float  # within-run slope of launch / speed on the step's requests


def side_means(
    t_obs: np.ndarray, v_obs: np.ndarray, t_at: np.ndarray, window_s: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(mean of v_obs within window_s before each t_at, within window_s after it, and their
    counts); `t_obs` sorted. An observation at t_at itself is on neither side."""
    cs = np.concatenate([[0.0], np.cumsum(v_obs)])
    lo = np.searchsorted(t_obs, t_at - window_s)
    mid_lo = np.searchsorted(t_obs, t_at)
    mid_hi = np.searchsorted(t_obs, t_at, side="right")
    hi = np.searchsorted(t_obs, t_at + window_s, side="right")
    nb, na = mid_lo - lo, hi - mid_hi
    with np.errstate(invalid="ignore", divide="ignore"):
        return (cs[mid_lo] - cs[lo]) / nb, (cs[hi] - cs[mid_hi]) / na, nb, na


def elasticities(
    log_launch: np.ndarray, before: np.ndarray, after: np.ndarray
) -> tuple[float, float]:
    """(OLS of log launch on the two-sided log speed, IV: on `before` instrumented by `after`)."""
    both = (before + after) / 2
    ols = float(np.cov(both, log_launch)[0, 1] / np.var(both, ddof=1))
    iv = float(np.cov(after, log_launch)[0, 1] / np.cov(after, before)[0, 1])
    return ols, iv


def rel_interval(
    y: np.ndarray, before: np.ndarray, after: np.ndarray, ref: float
) -> tuple[float, float]:
    """rel's 5th and 95th percentiles over BOOT resamples of the launches (ref held)."""
    rng = np.random.default_rng(0)
    rels = []
    for _ in range(BOOT):
        i = rng.integers(0, y.size, y.size)
        rels.append(elasticities(y[i], before[i], after[i])[1] / ref)
    lo, hi = np.percentile(rels, [5, 95])
    return float(lo), float(hi)


def around(
    t_obs: np.ndarray, v_obs: np.ndarray, t_at: np.ndarray, window_s: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(which t_at have MIN_SIDE_STEPS observations on each side, the before and after means
    there)."""
    before, after, nb, na = side_means(t_obs, v_obs, t_at, window_s)
    ok = (nb >= MIN_SIDE_STEPS) & (na >= MIN_SIDE_STEPS)
    return ok, before[ok], after[ok]


def eager_host(profile: dict, path: Path, window_s: float = WINDOW_S) -> EagerHost | None:
    """A run's eager launches against the host's speed around them; None with fewer than
    MIN_LAUNCHES of them."""
    run = load_run(path)
    steps = load_steps([run])
    (series,) = step_log_speeds(profile, [run], steps, OTHER_PHASES)
    graphed = steps.graph[series.rows]
    start = np.asarray(run.arrays("steps")["schedule_start_s"], np.float64)
    t_obs, v_obs = start[series.rows[graphed]], series.log_speed[graphed]
    launch = steps.phase_ms[LAUNCH]
    eager = np.flatnonzero(~steps.graph & np.isfinite(launch) & (launch > 0))
    ok, before, after = around(t_obs, v_obs, start[eager], window_s)
    if ok.sum() < MIN_LAUNCHES:
        return None
    eager = eager[ok]
    y = launch[eager]
    ols, iv = elasticities(np.log(y), before, after)
    ok_ref, b_ref, a_ref = around(t_obs, v_obs, t_obs, window_s)  # the graphed steps themselves
    ref = elasticities(v_obs[ok_ref], b_ref, a_ref)[1]
    lo, hi = rel_interval(np.log(y), before, after, ref)
    speed = np.exp((before + after) / 2)
    per = y / speed
    reqs = steps.cols["num_reqs"][eager]
    slope = float(np.polyfit(reqs, per, 1)[0]) if np.ptp(reqs) > 0 else 0.0
    med_speed, med_per = float(np.median(speed)), float(np.median(per))
    return EagerHost(int(y.size), med_speed, med_per, ols, iv, ref, iv / ref, lo, hi, slope)


def pooled_rel(rows: list[EagerHost]) -> float:
    """The runs' relative elasticities, weighted by their launches."""
    n = np.array([r.n for r in rows], np.float64)
    return float(np.sum(n * np.array([r.rel for r in rows])) / np.sum(n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--window-s", type=float, default=WINDOW_S, help="each side's window")
    args = ap.parse_args()
    profile = resolve_profile(load_profile(args.profile))
    print(f"{'run':<28} {'n':>5} {'speed':>6} {'launch/speed ms':>15} {'OLS':>5} {'IV':>5} "
          f"{'ref':>5} {'rel [5, 95 %]':>18} {'ms/req':>7}")  # fmt: skip
    rows = []
    for path in args.runs:
        r = eager_host(profile, path, args.window_s)
        name = f"{path.parent.name}/{path.name}"
        if r is None:
            print(f"{name:<28} fewer than {MIN_LAUNCHES} eager launches with the host around them")
            continue
        rows.append(r)
        print(f"{name:<28} {r.n:>5} {r.speed:>6.2f} {r.launch_per_speed_ms:>15.2f} "
              f"{r.ols:>5.2f} {r.iv:>5.2f} {r.ref:>5.2f} {r.rel:>5.2f} "
              f"[{r.rel_lo:.2f}, {r.rel_hi:.2f}] {r.ms_per_req:>+7.3f}")  # fmt: skip
    if rows:
        print(f"pooled rel (weighted by n, {len(rows)} runs): {pooled_rel(rows):.2f}")


if __name__ == "__main__":
    main()
