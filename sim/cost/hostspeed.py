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

`states` (optional, {"slow_over_fast": r >= 1, "fast_s": d_f > 0, "slow_s": d_s > 0}): the
host's two speeds (reports/fidelity/README.md section L: the measured log speed is bimodal, a
slow state ~1.75 x the fast one, slow stretches of 0.3-2 s, a run's level mostly its slow
share). The host stays in each state an exponential time of mean d_f (fast) or d_s (slow), so
it is slow a share pi = d_s / (d_f + d_s) of the time; the multiplier is m_f in the fast state
and r m_f in the slow one, m_f set so that its mean is 1 as `mean_over` says: over the steps
of a host-bound loop (E over time of 1 / multiplier = 1: m_f = 1 - pi + pi / r) or over time
(m_f = 1 / (1 - pi + pi r)) (`HostStates`). With `sigma` / `tau_s` as well the two multiply
(the processes' wander within a state); without them the states alone. The switches are drawn
per STATES_CHUNK_S seconds of time, chunk c's dwell times from a Generator seeded with
(config seed, stream, STATES_TAG, c), the state carried from chunk c - 1 (a dwell cut at a
chunk's end restarts there: the same law, the exponential having no memory). Not with `rho`.

The processes are drawn on a grid of GRID_S seconds (exact AR(1) steps, constant between grid
points) in chunks of CHUNK points, chunk c's innovations from a `numpy.random.Generator`
seeded with (config seed, stream, TAG, c) and the state carried from chunk c - 1: the
multiplier at time t is a function of (seed, stream, t) alone, never of the order in which the
step loop or the fast path (sim.fast) asks, so both see the same value and stay bit-identical.
"""

from __future__ import annotations

import bisect
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
STATES_KEY = "states"  # the host's two speeds (module docstring)
STATES_FIELDS = ("slow_over_fast", "fast_s", "slow_s")
STATES_TAG = 0x5354  # "ST": the states' streams, apart from the processes' (TAG)
STATES_CHUNK_S = 8.0


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


def _check_states(value: Any) -> None:
    """`states`: {"slow_over_fast": >= 1, "fast_s": > 0, "slow_s": > 0}."""
    if not isinstance(value, dict):
        raise HostSpeedError(STATES_KEY, f"expected an object with keys {list(STATES_FIELDS)}, "
                             f"got {value!r}")  # fmt: skip
    for k in value:
        if k not in STATES_FIELDS:
            raise HostSpeedError(f"{STATES_KEY}.{k}",
                                 f"unknown key, expected one of {list(STATES_FIELDS)}")  # fmt: skip
    for k in STATES_FIELDS:
        if k not in value:
            raise HostSpeedError(f"{STATES_KEY}.{k}", "missing")
        x = value[k]
        ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
        low, want = (
            (1.0, "a finite number >= 1") if k == "slow_over_fast" else (0.0, "a finite number > 0")
        )
        if not ok or x < low or (low == 0.0 and x == 0):
            raise HostSpeedError(f"{STATES_KEY}.{k}", f"expected {want}, got {x!r}")


def check_host_speed(value: Any) -> dict[str, Any] | None:
    """Check `host_speed`; returns its `cpu_spread` (None without) for the caller to check
    as a `cpu_spread` table. HostSpeedError names the sub-key (`sigma`, `tau_s[1]`)."""
    if not isinstance(value, dict):
        raise HostSpeedError("", "expected an object with keys 'sigma' and 'tau_s' (or 'states'), "
                             f"got {value!r}")  # fmt: skip
    allowed = ("sigma", "tau_s", "cpu_spread", "mean_over", RHO_KEY, STATES_KEY)
    for k in value:
        if k not in allowed:
            raise HostSpeedError(str(k), f"unknown key, expected one of {list(allowed)}")
    if STATES_KEY in value:
        _check_states(value[STATES_KEY])
        if RHO_KEY in value:
            raise HostSpeedError(RHO_KEY, f"the copula cannot be used with '{STATES_KEY}'")
    has = {k: k in value for k in ("sigma", "tau_s")}
    if STATES_KEY not in value or any(has.values()):  # the states alone need neither
        for k, present in has.items():
            if not present:
                raise HostSpeedError(k, "missing")
    if "sigma" in value:
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


class HostStates:
    """The host's two speeds (`states`, module docstring): the multiplier at a time."""

    __slots__ = ("speeds", "mean_s", "share", "key", "ends", "chunk", "times", "mults")

    def __init__(
        self, slow_over_fast: float, fast_s: float, slow_s: float, seed: int, stream: int = 0,
        mean_over: str = "steps",
    ) -> None:  # fmt: skip
        share = slow_s / (fast_s + slow_s)  # the time the host is slow
        r = slow_over_fast
        fast = (
            (1.0 - share + share / r) if mean_over == "steps" else 1.0 / (1.0 - share + share * r)
        )
        self.speeds = (fast, fast * r)  # by state: 0 fast, 1 slow
        self.mean_s = (fast_s, slow_s)
        self.share = share
        self.key = (int(seed), int(stream))
        self.ends: list[int] = []  # the state at the end of chunk c
        self.chunk = -1  # the chunk `times` and `mults` hold
        self.times: list[float] = []  # the chunk's start and its switches (s)
        self.mults: list[float] = []  # the multiplier from each of those times

    def _generate(self, c: int) -> tuple[list[float], list[float]]:
        """Chunk c's switch times and multipliers (chunks before it first: the state carries)."""
        while len(self.ends) < c:
            self._generate(len(self.ends))
        import numpy as np

        rng = np.random.default_rng([*self.key, STATES_TAG, c])
        # chunk 0 starts in the stationary law: slow with probability `share`
        state = int(rng.random() < self.share) if c == 0 else self.ends[c - 1]
        t = t0 = c * STATES_CHUNK_S
        end = t0 + STATES_CHUNK_S
        times, mults = [t0], [self.speeds[state]]
        while True:
            t += float(rng.exponential(self.mean_s[state]))
            if t >= end:
                break
            state = 1 - state
            times.append(t)
            mults.append(self.speeds[state])
        if c == len(self.ends):
            self.ends.append(state)
        return times, mults

    def at(self, t_s: float) -> float:
        """The multiplier at time `t_s` (seconds from the run's start; < 0 reads 0)."""
        c = int(t_s / STATES_CHUNK_S) if t_s > 0 else 0
        if c != self.chunk:
            self.times, self.mults = self._generate(c)
            self.chunk = c
        i = bisect.bisect_right(self.times, t_s) - 1
        return self.mults[i if i > 0 else 0]


class HostSpeed:
    """The multiplier of the host's speed at a time, for one replica's step loop: the
    processes' (sigma, tau_s), times the states' if any (`states`)."""

    __slots__ = ("a", "b", "sigma", "half_var", "key", "ends", "chunk", "window", "state",
                 "inv_sd", "states")  # fmt: skip

    def __init__(
        self, sigma: list[float], tau_s: list[float], seed: int, stream: int = 0,
        mean_over: str = "steps", states: HostStates | None = None,
    ) -> None:  # fmt: skip
        """No processes (empty `sigma`): the states alone, which must be given."""
        if not sigma and states is None:
            raise ValueError("a host speed needs processes or states")
        self.states = states
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
        states = self.states
        if not self.a:  # no processes: the states alone
            return states.at(t_s)  # type: ignore[union-attr]  # __init__ ensures them
        k = int(t_s / GRID_S) if t_s > 0 else 0
        c = k // CHUNK
        if c != self.chunk:
            self.window, self.state = self._generate(c)
            self.chunk = c
        v = self.window[k - c * CHUNK]
        return v if states is None else v * states.at(t_s)

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
    mean_over = hs.get("mean_over", "steps")
    st = hs.get(STATES_KEY)
    states = None
    if st is not None:
        states = HostStates(
            st["slow_over_fast"], st["fast_s"], st["slow_s"], seed, stream, mean_over
        )
    return HostSpeed(hs.get("sigma", []), hs.get("tau_s", []), seed, stream, mean_over, states)
