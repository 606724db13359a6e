"""`sim run --host-band`: the prediction on a host that stays fast and on one that stays slow.

A lease's host runs in two speed states, and its level is mostly its share of time in the slow
one, which no calibration run predicts (reports/fidelity/README.md section L). A profile with
`host_speed.states` (sim.cost.hostspeed) names the two speeds; the band is the same trace and
config predicted twice from a steady copy of the profile (`steady_profile`: no host process,
its `host_speed.cpu_spread` as the per-step spread) at `host_scale` x each state's multiplier
(`state_scales`, the profile's normalisation). On the fresh check sets the measured runs of
leases like the calibration's fell inside the band (widened by each metric's target) on 28 of
32 checks (reports/fidelity/host_band.py), and on 31 of 37 measured after the band was
committed, on five new H100 leases (sections L-N). Both runs are extra runs (sim.siderun:
beside the main run, on `sim run --jobs` processes). The run folder stays the profile's own
prediction; summary.json gets `host_band`: per state its host_scale and flat metrics
(bubblesim.core.runfmt.metrics).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bubblesim.core.config import Config
from bubblesim.core.runfmt.metrics import flat_metrics

from .cost.hostspeed import HOST_KEY, STATES_KEY, HostStates
from .cost.profile import ProfileError, load_profile
from .seeds import SHOWN, shown_unit

BAND_KEY = "host_band"
SPREAD_KEY = "cpu_spread"


def state_scales(host_speed: Mapping[str, Any]) -> tuple[float, float]:
    """(fast, slow) multipliers of a `host_speed` with states, under its `mean_over`."""
    st = host_speed[STATES_KEY]
    states = HostStates(
        st["slow_over_fast"], st["fast_s"], st["slow_s"], 0, 0,
        host_speed.get("mean_over", "steps"),
    )  # fmt: skip
    return states.speeds


def steady_profile(profile: Mapping[str, Any]) -> dict[str, Any]:
    """The profile without its host process: `host_speed.cpu_spread` (the phases' spread
    around the host's speed) becomes the per-step spread."""
    out = {k: v for k, v in profile.items() if k != HOST_KEY}
    spread = (profile.get(HOST_KEY) or {}).get(SPREAD_KEY)
    if spread is not None:
        out[SPREAD_KEY] = spread
    return out


def check_band(cfg: Config) -> dict[str, Any]:
    """The config's profile (read as written), which must have `host_speed.states`: one
    ProfileError naming what is missing."""
    if not cfg.profile:
        raise ProfileError("--host-band: no profile (set profile=PATH, a profile with "
                           f"{HOST_KEY}.{STATES_KEY})")  # fmt: skip
    profile = load_profile(cfg.profile)
    if STATES_KEY not in (profile.get(HOST_KEY) or {}):
        raise ProfileError(f"--host-band: profile '{cfg.profile}' has no {HOST_KEY}.{STATES_KEY} "
                           "(replay calibrate --host-states makes one)")  # fmt: skip
    return profile


def band_configs(cfg: Config, profile: Mapping[str, Any], folder: Path) -> dict[str, Config]:
    """The config on a host that stays fast and on one that stays slow: the steady profile
    (written into `folder`, which must outlive the runs) at host_scale x each state's
    multiplier."""
    fast, slow = state_scales(profile[HOST_KEY])
    steady = folder / "steady-profile.json"
    steady.write_text(json.dumps(steady_profile(profile)))
    return {
        name: cfg.replace(profile=str(steady), host_scale=cfg.host_scale * scale)
        for name, scale in (("fast", fast), ("slow", slow))
    }


def band_value(configs: Mapping[str, Config], summaries: Sequence[Mapping[str, Any]]) -> dict:
    """`host_band` from the runs of `band_configs` (their summaries in its order)."""
    return {
        name: {"host_scale": c.host_scale, "metrics": flat_metrics(summary)}
        for (name, c), summary in zip(configs.items(), summaries, strict=True)
    }


def band_lines(value: Mapping[str, Any]) -> list[str]:
    """The shown metrics on the fast and the slow host (ms for latencies, % for fractions)."""
    fast, slow = value["fast"], value["slow"]
    lines = [f"host band: a host that stays fast (host_scale {fast['host_scale']:.3f}) .. slow "
             f"({slow['host_scale']:.3f})"]  # fmt: skip
    for name in SHOWN:
        a, b = fast["metrics"].get(name), slow["metrics"].get(name)
        if a is None or b is None:
            continue
        scale, unit = shown_unit(name)
        lines.append(f"  {name:<18} {scale * a:10.3f} .. {scale * b:.3f} {unit}".rstrip())
    return lines
