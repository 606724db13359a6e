"""Does a host's CPU have two speeds by itself? A pure-Python probe, no engine and no GPU.

    python bench/cpu_states.py                      # one probe, 30 s, unpinned
    python bench/cpu_states.py --seconds 40 --cpus none,5,9 --write host-states.json

The engine's steps on the H100 and H200 hosts run in a fast and a slow state 1.6-1.8 x apart,
switching every 0.3-2 s (reports/fidelity/README.md section L). This asks whether the host
does so without the engine: each probe (one process, pinned to a CPU or `none`) repeats a fixed
unit of interpreted Python (dict and list work, ~0.1-0.2 ms) for --seconds and records each
unit's duration. Probes of one call run at the same time. Per probe it prints the units, their
median, and the two-state fit of its 0.1 s bins of log(duration / median)
(replay.analysis.hoststates.two_states): the slow state over the fast, the slow share, the slow
stretches (count, mean length) and how much better than one normal the mixture fits (BIC; > 10:
two states). With two or more probes it prints the correlation of their bin series (a
host-wide state reads near 1, one per core near 0). It also samples /proc/stat (steal time) and
the cores' MHz where the host has them, and prints the steal share in the slow bins against
the fast ones. `--write PATH` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replay.analysis.hoststates import BIN_S, slow_stretches, two_states  # noqa: E402

STAT_EVERY_S = 0.05


def unit() -> int:
    """A fixed unit of interpreted Python: dict updates and small lists, as a step loop does."""
    d: dict[int, int] = {}
    s = 0
    for i in range(400):
        d[i & 63] = d.get(i & 63, 0) + i
        s += len([j for j in range(8)])
    return s + len(d)


def probe(path: str, seconds: float, cpu: int | None, start: float) -> None:
    """Repeat `unit` from `start` (perf_counter) for `seconds`; save (start_s, dur_s) to path."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    starts: list[float] = []
    durs: list[float] = []
    end = start + seconds
    while time.perf_counter() < start:
        pass
    clock = time.perf_counter
    while (a := clock()) < end:
        unit()
        starts.append(a - start)
        durs.append(clock() - a)
    np.savez(path, start_s=np.array(starts), dur_s=np.array(durs))


def sample_stat(path: str, seconds: float, start: float) -> None:
    """/proc/stat's aggregate steal and total ticks, and the cores' MHz, every STAT_EVERY_S."""
    t: list[float] = []
    steal: list[int] = []
    total: list[int] = []
    mhz: list[float] = []
    while time.perf_counter() < start:
        time.sleep(0.001)
    while (now := time.perf_counter()) < start + seconds:
        try:
            with open("/proc/stat") as f:
                cpu = [int(x) for x in f.readline().split()[1:9]]
            with open("/proc/cpuinfo") as f:
                cores = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
        except OSError:
            return
        t.append(now - start)
        steal.append(cpu[7])
        total.append(sum(cpu))
        mhz.append(float(np.mean(cores)) if cores else float("nan"))
        time.sleep(STAT_EVERY_S)
    np.savez(path, t=np.array(t), steal=np.array(steal), total=np.array(total), mhz=np.array(mhz))


def bins(start_s: np.ndarray, dur_s: np.ndarray) -> np.ndarray:
    """Mean log(duration / median) per BIN_S bin of the units' start times."""
    b = (start_s // BIN_S).astype(np.int64)
    n = int(b.max()) + 1
    x = np.log(dur_s / np.median(dur_s))
    return np.bincount(b, x, n) / np.maximum(np.bincount(b, minlength=n), 1)


def probe_row(name: str, data: Any) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """One probe's row, its bin series and its bins' slow classification."""
    m = bins(data["start_s"], data["dur_s"])
    mix = two_states(m)
    slow = mix.slow_posterior(m) > 0.5
    st = slow_stretches(slow)
    row = {
        "probe": name,
        "units": int(data["dur_s"].size),
        "median_ms": float(np.median(data["dur_s"]) * 1e3),
        "slow_over_fast": float(np.exp(mix.mean[1] - mix.mean[0])),
        "slow_share": float(slow.mean()),
        "slow_stretches": len(st),
        "slow_stretch_s": float(BIN_S * np.mean(st)) if st else 0.0,
        "d_bic": float(mix.d_bic),
    }
    return row, m, slow


def steal_split(stat: Any, slow: np.ndarray) -> dict[str, float] | None:
    """The steal share of the ticks in the probe's slow bins and in its fast ones."""
    if stat is None or stat["t"].size < 3:
        return None
    mid = (stat["t"][1:] + stat["t"][:-1]) / 2
    b = (mid // BIN_S).astype(np.int64)
    ok = b < slow.size
    d_steal, d_total = np.diff(stat["steal"])[ok], np.diff(stat["total"])[ok]
    s = slow[b[ok]]
    share = {}
    for key, rows in (("steal_slow", s), ("steal_fast", ~s)):
        tot = float(d_total[rows].sum())
        share[key] = float(d_steal[rows].sum()) / tot if tot > 0 else float("nan")
    share["mhz_min"] = float(np.nanmin(stat["mhz"])) if np.isfinite(stat["mhz"]).any() else 0.0
    share["mhz_max"] = float(np.nanmax(stat["mhz"])) if np.isfinite(stat["mhz"]).any() else 0.0
    return share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--cpus", default="none", help="comma list of CPUs to pin a probe each to "
                    "('none': unpinned); distinct entries")  # fmt: skip
    ap.add_argument("--write", "--json", dest="write", metavar="PATH")
    args = ap.parse_args()
    pins: list[int | None] = [None if c == "none" else int(c) for c in args.cpus.split(",")]
    if len(set(pins)) != len(pins):
        ap.error("--cpus: each CPU (and 'none') at most once")
    with tempfile.TemporaryDirectory() as tmp:
        names = ["unpinned" if c is None else f"cpu{c}" for c in pins]
        start = time.perf_counter() + 0.5
        procs = [mp.Process(target=probe, args=(f"{tmp}/{n}.npz", args.seconds, c, start))
                 for n, c in zip(names, pins, strict=True)]  # fmt: skip
        procs.append(mp.Process(target=sample_stat, args=(f"{tmp}/stat.npz", args.seconds, start)))
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        stat = dict(np.load(f"{tmp}/stat.npz")) if Path(f"{tmp}/stat.npz").exists() else None
        loaded = [(n, dict(np.load(f"{tmp}/{n}.npz"))) for n in names]
    print(f"# python bench/cpu_states.py --seconds {args.seconds:g} --cpus {args.cpus}")
    print(f"# {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} "
          f"CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
    print(f"{'probe':<10} {'units':>8} {'median ms':>9} {'slow/fast':>9} {'share':>6} "
          f"{'stretches':>9} {'mean s':>6} {'dBIC':>7} {'steal slow/fast':>16} "
          f"{'MHz':>11}")  # fmt: skip
    rows, series = [], []
    for name, data in loaded:
        row, m, slow = probe_row(name, data)
        split = steal_split(stat, slow)
        if split is not None:
            row.update(split)
        rows.append(row)
        series.append(m)
        steal = f"{row['steal_slow']:.4f}/{row['steal_fast']:.4f}" if split else "-"
        mhz = f"{row['mhz_min']:.0f}-{row['mhz_max']:.0f}" if split else "-"
        print(f"{name:<10} {row['units']:>8} {row['median_ms']:>9.3f} "
              f"{row['slow_over_fast']:>9.2f} {row['slow_share']:>6.2f} "
              f"{row['slow_stretches']:>9} {row['slow_stretch_s']:>6.2f} {row['d_bic']:>7.1f} "
              f"{steal:>16} {mhz:>11}")  # fmt: skip
    for i in range(len(series)):
        for j in range(i + 1, len(series)):
            k = min(series[i].size, series[j].size)
            r = float(np.corrcoef(series[i][:k], series[j][:k])[0, 1])
            print(f"bins' correlation {names[i]} / {names[j]}: {r:+.2f}")
    if args.write:
        Path(args.write).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
