"""The host's slowly varying speed: one multiplier of every CPU phase, a function of time.

Measured on an H100 host, all CPU phases of a step run faster or slower together for a while
(0.1 s to seconds), whatever the batch: a per-step spread drawn independently (sim.cost.spread)
cannot make that, and it moves a whole request's TPOT. Profile key `host_speed`:

    {"sigma": [s1, ...], "tau_s": [t1, ...], "cpu_spread": {<phase>: table, ...},
     "mean_over": "steps" | "time"}

The log of the speed is a sum of independent stationary Ornstein-Uhlenbeck processes, one per
(sigma, tau_s) pair: standard deviation sigma, autocorrelation exp(-lag / tau_s). The
multiplier is exp(sum of the processes + sum sigma^2 / 2): its mean over the steps of a
host-bound loop (whose steps come at a rate ~ 1 / multiplier: fewer in the slow stretches) is
1, so there the phases keep their linear models' means, which are means over the measured steps
(the mean over time is exp(sum sigma^2); a GPU-bound loop, whose steps come at the GPU's pace,
hides the phases behind the GPU anyway). `mean_over: "time"` makes it exp(sum of the processes -
sum sigma^2 / 2), mean 1 over time: the calibration runs were GPU-bound, so their steps, whose
means the linear models are, came at the GPU's pace, and the phases that still show (a
tensor-parallel eager launch: llama3-70b TP4 on 4 x H100, ~100 ms) kept their means only so; the
default ("steps") ran them ~9 % long there (sigma 0.25 and 0.20: exp(sum sigma^2) = 1.11).
A step's launch phases (schedule .. draft) take the
multiplier at the step's start, process_outputs at its own start (sim.clock.StepClock.step);
GC pauses and waits are not multiplied. `cpu_spread` (optional): the phases' per-step spread
around the host's speed, which replaces the top-level `cpu_spread` while `host_speed` is on
(the top-level one holds the slow variation too). No `host_speed` (the default): no
multiplier, the simulator's arithmetic is unchanged.

`rho` (optional, {<phase>: rho}, 0 <= rho < 1): a Gaussian copula instead of the product. Each
phase's multiplier is then its TOP-LEVEL `cpu_spread` table (its measured marginal, host level
included) at u = Phi(rho z(t) + sqrt(1 - rho^2) e), z(t) the host's standardised state (the
processes' sum / sqrt(sum sigma^2), `HostSpeed.z_at`) and e a standard normal per (step, phase)
(sim.cost.spread); the multiplier h(t) is not applied then (the table holds the level), and
`host_speed.cpu_spread` is not read. A phase absent from `rho` (or rho 0) draws its table
independently, as without `host_speed`. Without `rho`: the product h(t) x residual above.
The product's median equals its mean (a log-Gaussian speed times a narrow residual); a
measured phase need not be so (the TP2 eager launch: bimodal, median 0.84 x its mean), and the
copula keeps the measured shape (reports/tp/README.md).

The processes are drawn on a grid of GRID_S seconds (exact AR(1) steps, constant between grid
points) in chunks of CHUNK points, chunk c's innovations from a `numpy.random.Generator`
seeded with (config seed, stream, TAG, c) and the state carried from chunk c - 1: the
multiplier at time t is a function of (seed, stream, t) alone, never of the order in which the
step loop or the fast path (sim.fast) asks, so both see the same value and stay bit-identical.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

from bubblesim.core.phases import CPU_PHASES

HOST_KEY = "host_speed"
GRID_S = 0.002
CHUNK = 1 << 12
TAG = 0x4853  # "HS": keeps these streams apart from the spread's (seed, stream, phase, block)
MAX_COMPONENTS = 4
MEAN_OVER = ("steps", "time")  # where the multiplier's mean is 1 (module docstring)
RHO_KEY = "rho"  # the copula's correlations (module docstring)


class HostSpeedError(ValueError):
    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


def _numbers(key: str, value: Any, positive: bool) -> list[float]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_COMPONENTS:
        want = f"a list of 1 to {MAX_COMPONENTS} numbers"
        raise HostSpeedError(key, f"expected {want}, got {value!r}")
    out = []
    for i, x in enumerate(value):
        ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
        if not ok or x < 0 or (positive and x == 0):
            want = "a finite number > 0" if positive else "a finite number >= 0"
            raise HostSpeedError(f"{key}[{i}]", f"expected {want}, got {x!r}")
        out.append(float(x))
    return out


def _check_rho(value: Any) -> None:
    """`rho`: {<CPU phase>: 0 <= rho < 1}."""
    if not isinstance(value, dict):
        raise HostSpeedError(RHO_KEY, f"expected an object of phase: correlation, got {value!r}")
    for phase, r in value.items():
        if phase not in CPU_PHASES:
            raise HostSpeedError(f"{RHO_KEY}.{phase}",
                                 f"unknown phase, expected one of {list(CPU_PHASES)}")  # fmt: skip
        ok = isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r)
        if not ok or not 0 <= r < 1:
            raise HostSpeedError(f"{RHO_KEY}.{phase}", f"expected a number in [0, 1), got {r!r}")


def check_host_speed(value: Any) -> dict[str, Any] | None:
    """Check `host_speed`; returns its `cpu_spread` (None without) for the caller to check
    as a `cpu_spread` table. HostSpeedError names the sub-key (`sigma`, `tau_s[1]`)."""
    if not isinstance(value, dict):
        raise HostSpeedError("", f"expected an object with keys 'sigma' and 'tau_s', got {value!r}")
    allowed = ("sigma", "tau_s", "cpu_spread", "mean_over", RHO_KEY)
    for k in value:
        if k not in allowed:
            raise HostSpeedError(str(k), f"unknown key, expected one of {list(allowed)}")
    for k in ("sigma", "tau_s"):
        if k not in value:
            raise HostSpeedError(k, "missing")
    sigma = _numbers("sigma", value["sigma"], positive=False)
    tau = _numbers("tau_s", value["tau_s"], positive=True)
    if len(sigma) != len(tau):
        want = f"{len(sigma)} numbers (one per sigma)"
        raise HostSpeedError("tau_s", f"expected {want}, got {len(tau)}")
    if value.get("mean_over", "steps") not in MEAN_OVER:
        raise HostSpeedError("mean_over", f"expected one of {list(MEAN_OVER)}, "
                             f"got {value['mean_over']!r}")  # fmt: skip
    if RHO_KEY in value:
        _check_rho(value[RHO_KEY])
    spread = value.get("cpu_spread")
    if spread is not None and not isinstance(spread, dict):
        raise HostSpeedError("cpu_spread", f"expected an object of phase tables, got {spread!r}")
    return spread


class HostSpeed:
    """The multiplier of the host's speed at a time, for one replica's step loop."""

    __slots__ = ("a", "b", "sigma", "half_var", "key", "ends", "chunk", "window", "state",
                 "inv_sd")  # fmt: skip

    def __init__(
        self, sigma: list[float], tau_s: list[float], seed: int, stream: int = 0,
        mean_over: str = "steps",
    ) -> None:  # fmt: skip
        self.a = [math.exp(-GRID_S / t) for t in tau_s]  # AR(1) step over GRID_S
        self.b = [s * math.sqrt(1.0 - a * a) for s, a in zip(sigma, self.a, strict=True)]
        self.sigma = list(sigma)
        half = sum(s * s for s in sigma) / 2
        self.half_var = half if mean_over == "steps" else -half  # added in the exponent
        self.key = (int(seed), int(stream))
        self.ends: list[list[float]] = []  # the processes' state at the end of chunk c
        self.chunk = -1  # the chunk `window` and `state` hold
        self.window: list[float] = []
        self.state: list[float] = []  # the processes' sum at the window's points
        var = sum(s * s for s in sigma)
        self.inv_sd = 1.0 / math.sqrt(var) if var > 0 else 0.0

    def _generate(self, c: int) -> tuple[list[float], list[float]]:
        """Chunk c's multipliers and the processes' sum at its points (chunks before it are
        generated first if needed: the state is carried through them)."""
        while len(self.ends) < c:
            self._generate(len(self.ends))
        import numpy as np

        eps = np.random.default_rng([*self.key, TAG, c]).standard_normal((len(self.a), CHUNK + 1))
        # the state before the chunk: chunk 0 starts from the stationary distribution
        x = [s * float(e[0]) for s, e in zip(self.sigma, eps, strict=True)]
        if c > 0:
            x = list(self.ends[c - 1])
        # one component at a time, then summed per point in component order: the same float
        # operations as a point-by-point loop over the components, a third of its time
        tot: list[float] | None = None
        for j, (a, b, e) in enumerate(zip(self.a, self.b, eps[:, 1:].tolist(), strict=True)):
            xj = x[j]
            path: list[float] = []
            add = path.append
            for ek in e:
                xj = a * xj + b * ek
                add(xj)
            x[j] = xj
            # 0.0 + first: the point loop's running sum from 0.0 (only a -0.0 changes, to 0.0)
            tot = [0.0 + v for v in path] if tot is None else list(map(operator.add, tot, path))
        exp, half = math.exp, self.half_var
        tot = tot or [0.0] * CHUNK
        out = [exp(t + half) for t in tot]
        if c == len(self.ends):
            self.ends.append(x)
        return out, tot

    def at(self, t_s: float) -> float:
        """The multiplier at time `t_s` (seconds from the run's start; < 0 reads 0)."""
        k = int(t_s / GRID_S) if t_s > 0 else 0
        c = k // CHUNK
        if c != self.chunk:
            self.window, self.state = self._generate(c)
            self.chunk = c
        return self.window[k - c * CHUNK]

    def z_at(self, t_s: float) -> float:
        """The host's standardised state at `t_s`: the processes' sum / sqrt(sum sigma^2),
        standard normal over time (0 when every sigma is 0). The same grid point as `at`."""
        k = int(t_s / GRID_S) if t_s > 0 else 0
        c = k // CHUNK
        if c != self.chunk:
            self.window, self.state = self._generate(c)
            self.chunk = c
        return self.state[k - c * CHUNK] * self.inv_sd


def host_speed(profile: Mapping[str, Any], seed: int, stream: int = 0) -> HostSpeed | None:
    """The host speed of a resolved profile's `host_speed`, or None when it has none."""
    hs = profile.get(HOST_KEY)
    if not hs:
        return None
    return HostSpeed(hs["sigma"], hs["tau_s"], seed, stream, hs.get("mean_over", "steps"))
