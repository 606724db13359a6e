"""`sim run --seeds N`: one prediction under N simulator seeds, and its spread.

A profile with a measured CPU spread or host speed (sim.cost.spread, sim.cost.hostspeed) draws
each step's CPU phases from a seeded stream: a slow host episode lands on some requests in one
seed and on others in the next, so one seed's TPOT or TTFT percentile is one draw of the host's
episodes (reports/fidelity/README.md: on llama3.2-1b the TTFT p50 of an Azure window spans -22
to +4 % of the measured over six seeds). The run folder is the config's seed; the seeds after
it (seed + 1 .. seed + N - 1) run without a folder of their own (sim.siderun: beside the main
run, on `sim run --jobs` processes), and summary.json gets
`seed_spread`: per flat metric (bubblesim.core.runfmt.metrics) the n, min, max, mean and the
relative stdev and range over all N, as `replay run --repeat`'s `repeat_spread` gives the
measured run-to-run spread. A config with nothing seeded (no spread, no host speed, a fixed
acceptance) gives N equal runs and a range of 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bubblesim.core.atomic import replacing
from bubblesim.core.config import Config
from bubblesim.core.runfmt.metrics import flat_metrics, spread

SPREAD_KEY = "seed_spread"
MAX_SEEDS = 100
SHOWN = ("output_tok_per_s", "tpot_s.p50", "tpot_s.p99", "ttft_s.p50", "e2e_s.p50",
         "bubble_fraction")  # fmt: skip


def seed_configs(cfg: Config, n: int) -> list[Config]:
    """The configs of seeds cfg.seed + 1 .. cfg.seed + n - 1 (run by sim.siderun)."""
    return [cfg.replace(seed=cfg.seed + i) for i in range(1, n)]


def seed_spread(summaries: list[Mapping[str, Any]], first_seed: int) -> dict[str, Any]:
    """`seed_spread` of the runs' summaries (the config's seed first, then the others)."""
    flats = [flat_metrics(s) for s in summaries]
    names = list(flats[0]) if flats else []
    return {
        "seeds": [first_seed + i for i in range(len(summaries))],
        "metrics": {n: spread([f[n] for f in flats]) for n in names},
    }


def add_to_summary(folder: Path, key: str, value: Mapping[str, Any]) -> dict[str, Any]:
    """Add `key` (`seed_spread`, sim.hostband's `host_band`) to the folder's summary.json
    (replaced whole, atomically)."""
    path = folder / "summary.json"
    summary = json.loads(path.read_text())
    summary[key] = value
    with replacing(path) as tmp:
        Path(tmp).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary


def shown_unit(name: str) -> tuple[float, str]:
    """(scale, unit) a SHOWN metric is printed in: ms for latencies, % for fractions."""
    if name.endswith("fraction"):
        return 100.0, "%"
    return (1e3, "ms") if name.endswith(("_s.p50", "_s.p99")) else (1.0, "")


def spread_lines(value: Mapping[str, Any]) -> list[str]:
    """The shown metrics as mean [min, max] over the seeds (ms for latencies, points for
    fractions)."""
    seeds = value["seeds"]
    lines = [f"over seeds {seeds[0]}..{seeds[-1]} ({len(seeds)}): mean [min, max]"]
    for name in SHOWN:
        s = value["metrics"].get(name) or {}
        if not s.get("n"):
            continue
        scale, unit = shown_unit(name)
        mean, lo, hi = (scale * s[k] for k in ("mean", "min", "max"))
        lines.append(f"  {name:<18} {mean:10.3f} [{lo:.3f}, {hi:.3f}] {unit}".rstrip())
    return lines
