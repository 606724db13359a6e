"""Attribution, not prediction: how much of a check's miss is its host's level.

For each measured check, the host's level against the profile's is the ratio of the measured
CPU phases' total time to what the profile predicts for the same steps (the run's own batch
shapes, every phase, launch included: replay.analysis.quality.phase_predicted_ms); the check is
then predicted again with `--set host_scale=<level>` and judged on the same targets. This
READS the measured run, so its table is no prediction: it says which misses a known host level
would remove (the rest are the model's).

    python reports/fidelity/host_level.py PROFILE RUNS_DIR --gpu h100 --prefix 1b- [--tag T]

With --eager-own the eager (prefill/mixed) launch is taken at its own measured level as well:
after the prediction at the host's level, the run is predicted again from a profile copy whose
`launch.eager_ms` is x (measured / predicted median eager launch), so that the eager launch's
median is the run's own (the median, not the mean: a few eager launches that wait behind long
prefills make a run's mean). What then still misses is neither the host's level nor the eager
launch's.

With --eager-shape the eager launch's spread is taken at its own measured shape too (implies
--eager-own): the copy's launch spread table (`host_speed.cpu_spread.launch`, else
`cpu_spread.launch`) becomes the quantiles of the run's eager launches over their mean (the
graph launches, ~20 us, draw from it as well), then `eager_ms` is scaled as above. A fast
host's eager launches sit on a floor with a long right tail (mean ~1.2 x median) where the
calibration run's may be symmetric, and --eager-own matches the median alone (section K).

With --own-states (a profile with `host_speed.states`, sim.cost.hostspeed) the host's slow
share is taken at the run's own as well: the copy's states keep the profile's ratio and cycle
(fast_s + slow_s) and split it at the share of the run's 0.1 s bins that read slow
(host_states.py's two-state fit of the run; kept within [MIN_SHARE, 1 - MIN_SHARE]). The level
is still `host_scale` (the states' mean is 1 at any share). A run with no two states of its
own keeps the profile's split. What then still misses is not the lease's host (section L).

With --seeds N the last prediction of each run is made with simulator seeds 0 .. N-1, and each
cell reads the mean error [min, max] over them (bold: the mean within target): the host's slow
process has a few independent stretches per run, so one seed's TTFT is partly its draw.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checks import (  # noqa: E402
    TARGETS,
    add_run_args,
    cell,
    error,
    measured_runs,
    predict_and_compare,
    within,
)
from eager_shape import eager_launch_ms  # noqa: E402

from replay.analysis.spread import SPREAD_P, TOP_P  # noqa: E402
from sim.cost.spread import mean_ratio  # noqa: E402

MIN_EAGER = 100  # fewer eager launches in a run: no shape of its own (--eager-shape)
MIN_SHARE = 0.02  # --own-states keeps the slow share within [this, 1 - this]
MIN_D_BIC = 10.0  # a run's bins must show two states this clearly (BIC) for its own share


def host_level(run_dir: Path, profile: Path) -> float:
    """Measured over predicted CPU phase time summed over the run's own steps."""
    from bubblesim.core.runfmt import load_run
    from replay.analysis.probe import host_level as level
    from sim.cost.profile import load_profile, resolve_profile

    return level(load_run(run_dir), resolve_profile(load_profile(profile)))


def eager_launch_p50(run_dir: Path) -> float | None:
    """Median launch ms over a run's eager (not graphed) steps; None when it has none."""
    y = eager_launch_ms(run_dir)
    return float(np.median(y)) if y.size else None


def own_shape(run_dir: Path) -> dict[str, list[float]] | None:
    """The run's eager launches as a spread table (sim.cost.spread): their quantiles at
    replay.analysis.spread's points over their mean (mean 1); None with fewer than MIN_EAGER."""
    y = eager_launch_ms(run_dir)
    y = y[y > 0]
    if y.size < MIN_EAGER:
        return None
    ratio = np.quantile(y, [*SPREAD_P[:-1], TOP_P]) / np.median(y)
    table = {"p": list(SPREAD_P), "ratio": [float(r) for r in ratio]}
    mean = mean_ratio(table)
    return {"p": table["p"], "ratio": [r / mean for r in table["ratio"]]}


def own_share(run_dir: Path, profile: Path) -> float | None:
    """The share of the run's 0.1 s bins that read slow (host_states.py), None where its bins
    show no two states (MIN_D_BIC)."""
    from host_states import run_states

    from sim.cost.profile import load_profile, resolve_profile

    r = run_states(resolve_profile(load_profile(profile)), run_dir)
    if r is None or r.mix.d_bic < MIN_D_BIC:
        return None
    return min(max(r.slow_share, MIN_SHARE), 1.0 - MIN_SHARE)


def own_profile(
    profile: Path, out: Path, factor: float = 1.0, shape: dict[str, list[float]] | None = None,
    share: float | None = None,
) -> Path:  # fmt: skip
    """A copy of `profile` whose eager launch base is x `factor` (the run's own eager level),
    given `shape`, whose launch spread table is it (where the simulator reads it: under
    `host_speed` when the profile has one without a copula, else the top-level `cpu_spread`),
    and given `share`, whose host states split their cycle at it (--own-states)."""
    data = json.loads(profile.read_text())
    data["launch"]["eager_ms"] = float(data["launch"]["eager_ms"]) * factor
    if share is not None:
        st = data["host_speed"]["states"]
        cycle = float(st["fast_s"]) + float(st["slow_s"])
        st["fast_s"], st["slow_s"] = (1.0 - share) * cycle, share * cycle
    if shape is not None:
        host = data.get("host_speed")
        if host is not None and "rho" not in host:
            host.setdefault("cpu_spread", dict(data.get("cpu_spread", {})))["launch"] = shape
        else:
            data.setdefault("cpu_spread", {})["launch"] = shape
    out.write_text(json.dumps(data, indent=1))
    return out


def seed_cells(runs: list[dict]) -> list[str]:
    """Per target, the mean error [min, max] over the seeds' comparisons (bold: the mean within
    target)."""
    cells = []
    for key, _, target in TARGETS:
        vals = [error(d["metrics"], key) for d in runs]
        if any(v is None for v in vals):
            cells.append("-")
            continue
        x = np.asarray(vals, float)
        mean = f"{x.mean():+.2f} pt" if key == "bubble_fraction" else f"{x.mean():+.1f} %"
        if within(key, float(x.mean()), target):
            mean = f"**{mean}**"
        cells.append(f"{mean} [{x.min():+.1f}, {x.max():+.1f}]")
    return cells


def at_own_level(
    meas: Path, summary: dict, level: float, args: argparse.Namespace, share: float | None = None
) -> tuple[str, list[dict]]:
    """The run predicted at its host's `level` (and, per the flags, its eager launch's shape and
    median, and its slow `share`): the eager column's cell and the comparisons, one per seed."""
    name = f"{meas.name}{f'-{args.tag}' if args.tag else ''}-host"
    at_level = (f"host_scale={level:.4f}",)
    shape = own_shape(meas) if args.eager_shape else None
    profile = args.profile
    if share is not None:
        name = f"{name}-states"
    if shape is not None or share is not None:  # the median below is read with them
        name = f"{name}-shape" if shape is not None else name
        profile = own_profile(args.profile, args.work / f"{name}.json", shape=shape, share=share)
    data = predict_and_compare(
        meas, summary, profile, args.gpu, args.work, name, extra_sets=at_level
    )
    eager = ""
    if args.eager_own:
        meas_p50 = eager_launch_p50(meas)
        pred_p50 = eager_launch_p50(args.work / f"sim-{name}")
        eager = " - |"
        if meas_p50 is not None and pred_p50:
            factor = meas_p50 / pred_p50
            eager = f" x{factor:.2f} |"
            name = f"{name}-eager"
            profile = own_profile(args.profile, args.work / f"{name}.json", factor, shape, share)
            data = predict_and_compare(
                meas, summary, profile, args.gpu, args.work, name, extra_sets=at_level
            )
    others = [
        predict_and_compare(
            meas, summary, profile, args.gpu, args.work, f"{name}-s{seed}", seed, at_level
        )
        for seed in range(1, args.seeds)
    ]
    return eager, [data, *others]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument(
        "--eager-own", action="store_true",
        help="also take the eager launch at the run's own measured level (an attribution)",
    )  # fmt: skip
    ap.add_argument(
        "--eager-shape", action="store_true",
        help="also take the eager launch's spread at the run's own measured shape (implies "
        "--eager-own)",
    )  # fmt: skip
    ap.add_argument(
        "--own-states", action="store_true",
        help="also take the host's slow share at the run's own (a profile with "
        "host_speed.states; an attribution)",
    )  # fmt: skip
    ap.add_argument(
        "--seeds", type=int, default=1,
        help="predict each run's last variant with seeds 0 .. N-1: cells read the mean error "
        "[min, max]",
    )  # fmt: skip
    ap.add_argument(
        "--with-calib", action="store_true",
        help="also the runs named *-calib* (left out by default: a profile's own runs)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.seeds < 1:
        raise SystemExit(f"--seeds: expected >= 1, got {args.seeds}")
    args.eager_own = args.eager_own or args.eager_shape
    if args.own_states and "states" not in json.loads(args.profile.read_text()).get(
        "host_speed", {}
    ):
        raise SystemExit(f"--own-states: {args.profile} has no host_speed.states")
    args.work.mkdir(parents=True, exist_ok=True)
    eager_col = " eager launch p50, measured / predicted |" if args.eager_own else ""
    head = f"| run | host level |{eager_col} " + " | ".join(c for _, c, _ in TARGETS) + " |"
    rows = [head, "|---" * (len(TARGETS) + 2 + args.eager_own) + "|"]
    for meas, summary in measured_runs(args.runs, args.prefix):
        if "-calib" in meas.name and not args.with_calib:
            continue
        level = host_level(meas, args.profile)
        share = own_share(meas, args.profile) if args.own_states else None
        eager, runs = at_own_level(meas, summary, level, args, share)
        cells = seed_cells(runs) if args.seeds > 1 else [cell(runs[0], k, t) for k, _, t in TARGETS]
        host = f"x{level:.2f}" + (f", slow share {share:.2f}" if share is not None else "")
        rows.append(f"| {meas.name} | {host} |{eager} " + " | ".join(cells) + " |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
