"""The eager-step lag at TP the tp README cites: how long after rank 0's launch end an eager
step's GPU work ends, measured per run on the steps whose kernels (by the profile) end before
the last rank's launch (replay.analysis.eagerlag), its correlation with rank 0's own launch,
and what the simulator's model of it gives (sim.clock.StepClock): with the profile's measured
`tp_ranks`, R = exp(intercept) x m ** slope x residual and the lag = m x launch x (R - 1) when
positive (m: rank 0's launch multiplier from the launch spread); without it, the other ranks'
multipliers drawn from the launch spread, the lag = the launch x (the largest other draw -
rank 0's) when positive. Where the run recorded the worker ranks' own launches (ranks.parquet,
replay.analysis.ranks), also: where the last worker rank's launch ended after rank 0's (p50,
mean of the positive part, the share of steps where rank 0 was the last), and where the GPU
ended after the later of the two (p50); then per worker rank, over the eager steps: its launch
start after rank 0's (p50) and the correlation of its launch length's log with rank 0's.

    python reports/tp/eager_lag.py PROFILE RUN_DIR [RUN_DIR ...]

e.g. `reports/tp/profile-h100x4-llama3-70b-tp4.json reports/tp/runs4/70b-tp4-*
reports/tp/runs3/70b-tp4-*` (TP4) and the TP2 profile with `runs4/8b-tp2-* runs3/8b-tp2-*`
(check runs out of the tree: reports/tp/README.md says which commit restores them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.eagerlag import eager_ends  # noqa: E402
from replay.analysis.ranks import read_ranks  # noqa: E402
from replay.analysis.steps import load_steps  # noqa: E402
from sim.cost.hostspeed import HOST_KEY  # noqa: E402
from sim.cost.profile import TP_KEY, load_profile, resolve_profile  # noqa: E402
from sim.cost.spread import RANKS_KEY, SPREAD_KEY, draw  # noqa: E402

DRAWS = 200_000


def modelled_lag_ms(prof: dict) -> np.ndarray:
    """Lag samples (ms) of the simulator's model for an eager step at the profile's launch."""
    tables = (prof.get(HOST_KEY) or {}).get(SPREAD_KEY) or prof.get(SPREAD_KEY) or {}
    ranks = int(prof.get(TP_KEY, 1))
    if "launch" not in tables or ranks < 2:
        return np.zeros(1)
    m = draw(tables["launch"], np.random.default_rng(0).random((DRAWS, ranks)))
    fit = prof.get(RANKS_KEY)
    if fit is not None:
        resid = draw(fit["residual"], np.random.default_rng(1).random(DRAWS))
        r = np.exp(fit["intercept"]) * m[:, 0] ** fit["slope"] * resid
        return np.maximum(0.0, r - 1.0) * m[:, 0] * prof["launch"]["eager_ms"]
    return np.maximum(0.0, m[:, 1:].max(axis=1) - m[:, 0]) * prof["launch"]["eager_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", type=Path, nargs="+")
    args = ap.parse_args()
    prof = resolve_profile(load_profile(args.profile))
    model = modelled_lag_ms(prof)
    print(f"model ({args.profile.name}): lag mean {model.mean():.2f} ms, p50 "
          f"{np.median(model):.2f} ms")  # fmt: skip
    print("run | launch-bound eager steps | lag p50 ms | lag mean ms | rank 0 launch p50 ms | "
          "corr(lag, launch) | last worker after rank 0 p50 / mean+ ms, rank 0 last | "
          "GPU end after the last launch p50 ms")  # fmt: skip
    for d in args.runs:
        run = load_run(d)
        ends = eager_ends([run], load_steps([run]), prof)
        bound = ends.launch_bound()
        lag, launch = ends.gpu_end_ms[bound], ends.launch_ms[bound]
        if lag.size < 3:  # a prefill-bound run: its kernels outlast every launch
            print(f"{d.name} | {lag.size} | - | - | - | -")
            continue
        corr = float(np.corrcoef(lag, launch)[0, 1])
        rk = ends.ranks_end_ms
        if np.isfinite(rk).any():
            ok = np.isfinite(rk)
            after = (ends.gpu_end_ms - ends.issue_end_ms())[bound & ok]
            ranks = (f"{np.median(rk[ok]):.2f} / {np.fmax(rk[ok], 0).mean():.2f}, "
                     f"{np.mean(rk[ok] <= 0):.2f} | {np.median(after):.3f}")  # fmt: skip
        else:
            ranks = "- | -"
        print(f"{d.name} | {lag.size} | {np.median(lag):.2f} | {lag.mean():.2f} | "
              f"{np.median(launch):.1f} | {corr:+.2f} | {ranks}")  # fmt: skip
    for d in args.runs:
        per_rank(d)


def per_rank(run_dir: Path) -> None:
    """Per worker rank of a run with ranks.parquet: launch start after rank 0's, and the log
    correlation of the launch lengths, over the eager steps (replay.analysis.steps' rule)."""
    ranks = read_ranks(run_dir)
    if ranks is None:
        return
    run = load_run(run_dir)
    steps = load_steps([run])
    s = run.arrays("steps")
    eager = ~steps.graph & np.isfinite(s["launch_end_s"])
    r0 = (s["launch_end_s"] - s["launch_start_s"]) * 1e3
    for rank in sorted(set(ranks.rank.tolist())):
        mine = (ranks.rank == rank) & eager[ranks.step]
        st = ranks.step[mine]
        start_ms = (ranks.launch_start_s[mine] - s["launch_start_s"][st]) * 1e3
        own = (ranks.launch_end_s[mine] - ranks.launch_start_s[mine]) * 1e3
        ok = (own > 0) & (r0[st] > 0)
        corr = float(np.corrcoef(np.log(own[ok]), np.log(r0[st][ok]))[0, 1])
        print(f"  {run_dir.name} rank {rank}: {int(mine.sum())} eager steps, launch start "
              f"{np.median(start_ms):.2f} ms after rank 0's (p50), launch p50 "
              f"{np.median(own):.1f} ms, log correlation with rank 0's {corr:+.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
