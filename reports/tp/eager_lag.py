"""The eager-step lag at TP the tp README cites: how long after rank 0's launch end an eager
step's GPU work ends, measured per run on the steps whose kernels (by the profile) end before
the launch (replay.analysis.eagerlag), its correlation with rank 0's own launch, and what the
simulator's model of it gives: the other ranks' launch multipliers drawn from the profile's
launch spread (sim.clock.StepClock), the lag = the launch x (the largest other draw - rank 0's)
when positive.

    python reports/tp/eager_lag.py PROFILE RUN_DIR [RUN_DIR ...]

e.g. `reports/tp/profile-h100x4-llama3-70b-tp4.json reports/tp/runs/70b-tp4-calib70
reports/tp/runs3/70b-tp4-*` (TP4) and the TP2 profile with `runs/8b-tp2-calib runs3/8b-tp2-*`.
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
from replay.analysis.steps import load_steps  # noqa: E402
from sim.cost.hostspeed import HOST_KEY  # noqa: E402
from sim.cost.profile import TP_KEY, load_profile, resolve_profile  # noqa: E402
from sim.cost.spread import SPREAD_KEY, draw  # noqa: E402

DRAWS = 200_000


def modelled_lag_ms(prof: dict) -> np.ndarray:
    """Lag samples (ms) of the simulator's model for an eager step at the profile's launch."""
    tables = (prof.get(HOST_KEY) or {}).get(SPREAD_KEY) or prof.get(SPREAD_KEY) or {}
    ranks = int(prof.get(TP_KEY, 1))
    if "launch" not in tables or ranks < 2:
        return np.zeros(1)
    m = draw(tables["launch"], np.random.default_rng(0).random((DRAWS, ranks)))
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
          "corr(lag, launch)")  # fmt: skip
    for d in args.runs:
        run = load_run(d)
        ends = eager_ends([run], load_steps([run]), prof)
        bound = ends.launch_bound()
        lag, launch = ends.gpu_end_ms[bound], ends.launch_ms[bound]
        if lag.size < 3:  # a prefill-bound run: its kernels outlast every launch
            print(f"{d.name} | {lag.size} | - | - | - | -")
            continue
        corr = float(np.corrcoef(lag, launch)[0, 1])
        print(f"{d.name} | {lag.size} | {np.median(lag):.2f} | {lag.mean():.2f} | "
              f"{np.median(launch):.1f} | {corr:+.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
