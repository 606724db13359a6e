"""A planner's band over the lease's host: each check predicted on a host that stays fast and on one
that stays slow, and whether the measured run falls between (section L).

    python reports/fidelity/host_band.py PROFILE RUNS_DIR --gpu h100 --prefix 1b- [--tag T]

PROFILE has `host_speed.states` (a two-state host, sim.cost.hostspeed). A lease's level is mostly
its share of slow time, which no calibration run predicts; the two states bound it. Each check
is predicted twice from a steady copy of PROFILE (the states and processes removed, their
`host_speed.cpu_spread` as the per-step spread) at `host_scale` = the fast state's multiplier and
at the slow one's (the profile's normalisation: m_f = 1 - pi + pi / r for `mean_over` steps),
as `sim run --host-band` does (sim.hostband), here beside the measured runs.
Per check and metric it prints the measured value, the two predictions and IN where the
measured value lies between them, "in (+x %)" where it lies outside by no more than the
metric's target (reports/fidelity/checks.py: a point prediction within target is a hit, so is
a band's edge), or its distance outside the band in % of the nearer edge; last, per metric,
how many checks fall inside. The prediction at the profile itself (section L's tables) is a
point inside this band.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checks import TARGETS, add_run_args, measured_runs, predict_and_compare  # noqa: E402

from sim.hostband import state_scales  # noqa: E402
from sim.hostband import steady_profile as steady  # noqa: E402

KEYS = ("output_tok_per_s", "tpot_s.p50", "tpot_s.p99", "ttft_s.p50", "e2e_s.p50")
TARGET = {k: t for k, _, t in TARGETS}


def steady_profile(profile: Path, out: Path) -> tuple[Path, float, float]:
    """A copy of `profile` without its host process (sim.hostband.steady_profile) written to
    `out`, and the fast and slow scales of its states."""
    data = json.loads(profile.read_text())
    host = data.get("host_speed") or {}
    if "states" not in host:
        raise SystemExit(f"{profile}: no host_speed.states (a two-state profile is needed)")
    fast, slow = state_scales(host)
    out.write_text(json.dumps(steady(data), indent=1))
    return out, fast, slow


def band_cell(key: str, measured: float, a: float, b: float) -> tuple[str, bool]:
    """'IN' where `measured` is within [min(a, b), max(a, b)] widened by key's target (a
    fraction of the nearer edge), else its distance outside in % of that edge."""
    lo, hi = min(a, b), max(a, b)
    if lo <= measured <= hi:
        return "IN", True
    edge = lo if measured < lo else hi
    off = (measured - edge) / edge
    ok = abs(off) <= TARGET[key]
    return (f"in ({100 * off:+.1f} %)" if ok else f"{100 * off:+.1f} %"), ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--with-calib", action="store_true", help="also the runs named *-calib*")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    sfx = f"-{args.tag}" if args.tag else ""
    steady, fast, slow = steady_profile(args.profile, args.work / f"steady{sfx}.json")
    print(f"host_scale: fast state {fast:.3f}, slow state {slow:.3f}")
    print("| run | " + " | ".join(f"{k}: measured, fast..slow" for k in KEYS) + " |")
    print("|---" * (len(KEYS) + 1) + "|")
    inside = dict.fromkeys(KEYS, 0)
    n = 0
    for meas, summary in measured_runs(args.runs, args.prefix):
        if "-calib" in meas.name and not args.with_calib:
            continue
        n += 1
        ends = [
            predict_and_compare(meas, summary, steady, args.gpu, args.work,
                                f"{meas.name}{sfx}-{side}", 0, (f"host_scale={scale:.4f}",))
            for side, scale in (("fast", fast), ("slow", slow))
        ]  # fmt: skip
        cells = []
        for k in KEYS:
            m_f, m_s = ends[0]["metrics"][k], ends[1]["metrics"][k]
            measured = float(m_f["measured"])
            text, ok = band_cell(k, measured, float(m_f["predicted"]), float(m_s["predicted"]))
            inside[k] += ok
            unit = 1.0 if k == "output_tok_per_s" else 1e3
            cells.append(f"{unit * measured:.4g}, {unit * m_f['predicted']:.4g}.."
                         f"{unit * m_s['predicted']:.4g} {text}")  # fmt: skip
        print(f"| {meas.name} | " + " | ".join(cells) + " |")
    print("\ninside the band widened by each target (latencies in ms, throughput in tok/s): "
          + ", ".join(f"{k} {inside[k]}/{n}" for k in KEYS))  # fmt: skip


if __name__ == "__main__":
    main()
