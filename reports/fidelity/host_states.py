"""The host's speed has two states: a run's level is how long it spends in the slow one (section L).

    python reports/fidelity/host_states.py PROFILE RUN [RUN ...] [--bin-s 0.1]

Per run folder (measured or simulated): its steps' log host speed (log of the measured CPU
phases over what PROFILE predicts, replay.analysis.hostspeed) averaged over bins of --bin-s
seconds, fitted by a two-component normal mixture (EM, `two_states`). Printed per run:
- level: exp(the mean log speed), the run's host against the profile's;
- fast and slow: exp(each component's mean); slow/fast, their ratio;
- slow share: the bins more likely slow than fast; episodes: how many slow stretches, and
  their mean length in s (a stretch is consecutive slow bins);
- dBIC: the single normal's BIC less the mixture's (> 10: the two states are clear).
The last lines pool every run's bins (the same profile, so the same scale) and say how much of
the runs' spread in level the slow share explains: the level each run would have at the
pooled fast and slow speeds and its own share, against its measured level.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.hostspeed import binned, step_log_speeds  # noqa: E402
from replay.analysis.hoststates import BIN_S, MIN_BINS, Mixture, slow_stretches, two_states  # noqa: E402
from replay.analysis.steps import load_steps  # noqa: E402
from sim.cost.profile import load_profile, resolve_profile  # noqa: E402


@dataclass
class RunStates:
    name: str
    bins: np.ndarray  # mean log speed per bin (finite ones, in time order)
    level: float
    mix: Mixture
    slow_share: float
    stretches: list[int]


def run_states(profile: dict, path: Path, bin_s: float = BIN_S) -> RunStates | None:
    """A run's two host states; None with fewer than MIN_BINS bins."""
    run = load_run(path)
    (series,) = step_log_speeds(profile, [run], load_steps([run]))
    means, _ = binned(series, bin_s)
    x = means[np.isfinite(means)]
    if x.size < MIN_BINS:
        return None
    mix = two_states(x)
    slow = mix.slow_posterior(x) > 0.5
    name = f"{path.parent.name}/{path.name}"
    level = float(np.exp(series.log_speed.mean()))
    return RunStates(name, x, level, mix, float(slow.mean()), slow_stretches(slow))


def line(r: RunStates, bin_s: float) -> str:
    fast, slow = (math.exp(v) for v in r.mix.mean)
    mean_len = bin_s * float(np.mean(r.stretches)) if r.stretches else 0.0
    return (
        f"{r.name:<30} {r.level:>5.2f} {fast:>5.2f} {slow:>5.2f} {slow / fast:>5.2f} "
        f"{r.slow_share:>5.2f} {len(r.stretches):>5d} {mean_len:>6.2f} {r.mix.d_bic:>7.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--bin-s", type=float, default=BIN_S, help="the bins' length in seconds")
    args = ap.parse_args()
    profile = resolve_profile(load_profile(args.profile))
    print(f"{'run':<30} {'level':>5} {'fast':>5} {'slow':>5} {'s/f':>5} {'share':>5} "
          f"{'epis':>5} {'mean s':>6} {'dBIC':>7}")  # fmt: skip
    rows = []
    for path in args.runs:
        r = run_states(profile, path, args.bin_s)
        if r is None:
            print(f"{path.parent.name}/{path.name}: fewer than {MIN_BINS} bins")
            continue
        rows.append(r)
        print(line(r, args.bin_s))
    if len(rows) < 2:
        return
    pooled = two_states(np.concatenate([r.bins for r in rows]))
    fast, slow = (math.exp(v) for v in pooled.mean)
    print(f"pooled ({len(rows)} runs): fast {fast:.2f}, slow {slow:.2f} (x{slow / fast:.2f}), "
          f"slow share {pooled.weight_slow:.2f}, dBIC {pooled.d_bic:.1f}")  # fmt: skip
    # each run's level from the pooled states and its own share, against its measured level
    lo, hi = pooled.mean
    shares = [float((pooled.slow_posterior(r.bins) > 0.5).mean()) for r in rows]
    from_share = np.array([math.exp(lo + s * (hi - lo)) for s in shares])
    level = np.array([math.exp(r.bins.mean()) for r in rows])
    r2 = 1 - float(np.var(np.log(level / from_share)) / np.var(np.log(level)))
    print(f"the runs' bin-mean level from the pooled states and their own slow share: "
          f"log R^2 {r2:.2f}; per run (level / from share): "
          + " ".join(f"{a / b:.2f}" for a, b in zip(level, from_share)))  # fmt: skip


if __name__ == "__main__":
    main()
