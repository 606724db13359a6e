"""Measured spread of the CPU phases: per-step multipliers drawn from a seeded stream.

A phase's linear model (sim.cost.model) gives its mean time for a batch shape; a real host
takes more or less from one step to the next (cache misses, the allocator, interrupts, another
thread). Profile key `cpu_spread.<phase>` describes that spread as the distribution of
measured / predicted time, a quantile table:

    {"p": [0.0, 0.01, ..., 0.999, 1.0], "ratio": [r0, r1, ..., rn]}

p strictly increasing from 0 to 1, ratio non-decreasing and >= 0: the inverse CDF, linear
between the points (so a heavy tail is the last segments: p 0.99 -> 0.999 -> 1). The
simulator multiplies the phase's time of step i (launch: with launch_ms; not its GC pause) by
ratio(u), u uniform in [0, 1), one u per (step, phase). `replay calibrate` writes the table
normalised to mean 1 (`mean_ratio`), so the phase's mean stays the linear model's.

The multipliers of a phase come in blocks of BLOCK_STEPS steps, block b drawn from its own
`numpy.random.Generator` seeded with (config seed, stream, phase index, b): the multiplier of
(step, phase) is a function of those alone, never of the order in which the step loop and the
fast path (sim.fast) asks for it, so both see the same value and
stay bit-identical. `stream` tells replicas behind a router apart. No `cpu_spread` (the
default): no multiplier, the simulator's arithmetic is unchanged. With tensor parallelism
`PhaseSpread.others_max` draws the launch phase of the other ranks (their own eager launch of a
step) from another stream, seeded with (seed, stream, phase index, b, 1, ranks), unless the
profile holds the measured `tp_ranks` (replay calibrate, from the worker ranks' own launch
records, replay.analysis.eagerlag.fit_rank_launches): R, where the last worker rank's launch
ends from rank 0's launch start in units of rank 0's launch, is
exp(intercept) x m ** slope x e, with m rank 0's launch multiplier at the step and e drawn
from the `residual` quantile table (not normalised) per step, from the stream
(seed, stream, 2**31, b, 2) (`PhaseSpread.ranks_end`). Measured on 2 and 4 x H100, R falls as
rank 0's launch grows (slope -0.59 at TP4, -0.66 at TP2 on the calibration runs): drawn
independently of it, the lag came out ~50 % too long (reports/tp/README.md).

With a `host_speed` (sim.cost.hostspeed) the tables are `host_speed.cpu_spread` (the spread
around the host's speed; none: the top-level `cpu_spread`) and `PhaseSpread.host` holds the
speed, which sim.clock.StepClock multiplies the phases by as well. With `host_speed.rho` (the
copula, sim.cost.hostspeed) the tables are the top-level ones, `host` is None and
`PhaseSpread.state` holds the speed for its state z(t): a phase with rho > 0 is drawn at
u = Phi(rho z(t) + sqrt(1 - rho^2) e) by `row_at` / `at_time` / `others_max(..., t_s)`, e =
Phi^-1 of the same uniform `row` draws from its table (seeded as above), so the draws stay a
function of (seed, stream, phase, block) and the step's time. Phases with rho 0 keep `row`'s
draws to the bit; the other ranks' launches (`others_max`) take the largest of their uniforms'
normal scores at the same z (the same host).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bubblesim.core.phases import CPU_PHASES

from .hostspeed import HOST_KEY, RHO_KEY, HostSpeed, host_speed

if TYPE_CHECKING:
    import numpy as np

SPREAD_KEY = "cpu_spread"
RANKS_KEY = "tp_ranks"  # {"intercept", "slope", "residual": table, "steps"}: module docstring
BLOCK_STEPS = 1 << 16
U_MIN = 2.0**-53  # a uniform of 0 reads this in a normal score (Phi^-1(0) is -inf)


class SpreadError(ValueError):
    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


def _numbers(key: str, value: Any) -> list[float]:
    if not isinstance(value, list) or len(value) < 2:
        raise SpreadError(key, f"expected a list of 2 or more numbers, got {value!r}")
    out = []
    for i, x in enumerate(value):
        ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
        if not ok:
            raise SpreadError(f"{key}[{i}]", f"expected a finite number, got {x!r}")
        out.append(float(x))
    return out


def check_spread(value: Any) -> None:
    """One phase's table; SpreadError names the sub-key (`p`, `ratio`, `p[3]`)."""
    if not isinstance(value, dict):
        raise SpreadError("", f"expected an object with keys 'p' and 'ratio', got {value!r}")
    for k in value:
        if k not in ("p", "ratio"):
            raise SpreadError(str(k), "unknown key, expected one of ['p', 'ratio']")
    for k in ("p", "ratio"):
        if k not in value:
            raise SpreadError(k, "missing")
    p, ratio = _numbers("p", value["p"]), _numbers("ratio", value["ratio"])
    if len(p) != len(ratio):
        raise SpreadError("ratio", f"expected {len(p)} numbers (one per p), got {len(ratio)}")
    if p[0] != 0.0 or p[-1] != 1.0:
        raise SpreadError("p", f"must run from 0 to 1, got {p[0]!r} .. {p[-1]!r}")
    for i in range(1, len(p)):
        if not p[i] > p[i - 1]:
            raise SpreadError(f"p[{i}]", f"must be above p[{i - 1}] ({p[i - 1]!r}), got {p[i]!r}")
        if ratio[i] < ratio[i - 1]:
            raise SpreadError(f"ratio[{i}]", f"must be >= ratio[{i - 1}], got {ratio[i]!r}")
    if ratio[0] < 0:
        raise SpreadError("ratio[0]", f"must be >= 0, got {ratio[0]!r}")


def mean_ratio(table: Mapping[str, Any]) -> float:
    """The mean multiplier: the integral of the piecewise-linear inverse CDF."""
    import numpy as np

    p, r = np.asarray(table["p"], np.float64), np.asarray(table["ratio"], np.float64)
    return float(np.sum(np.diff(p) * (r[1:] + r[:-1]) / 2))


def draw(table: Mapping[str, Any], u: np.ndarray) -> np.ndarray:
    """Multipliers for uniforms `u` in [0, 1): the table's inverse CDF."""
    import numpy as np

    return np.interp(u, table["p"], table["ratio"])


def normal_scores(u: np.ndarray) -> list[float]:
    """Phi^-1(u) of uniforms in [0, 1) (0 reads U_MIN): the copula's e."""
    from statistics import NormalDist

    inv = NormalDist().inv_cdf
    return [inv(x if x > U_MIN else U_MIN) for x in u.tolist()]


def draw_one(p: list[float], ratio: list[float], u: float) -> float:
    """`draw` of one uniform in [0, 1] (np.interp's arithmetic, without numpy's per-call cost)."""
    j = bisect.bisect_right(p, u) - 1
    if j >= len(p) - 1:
        return ratio[-1]
    if j < 0:
        return ratio[0]
    return ratio[j] + (u - p[j]) * (ratio[j + 1] - ratio[j]) / (p[j + 1] - p[j])


class PhaseSpread:
    """Per-step multipliers of the CPU phases, for one replica's step loop.

    `window[i]` is the list of multipliers of CPU_PHASES[i] for steps lo .. hi - 1 (phases
    without a table: 1.0); `ensure(first, last)` moves the window to cover those steps (whole
    blocks, the earlier ones dropped). The loops index it as `window[i][step - lo]`."""

    def __init__(
        self, spread: Mapping[str, Any], seed: int, stream: int = 0, host: HostSpeed | None = None,
        ranks: Mapping[str, Any] | None = None, rho: Mapping[str, float] | None = None,
    ) -> None:  # fmt: skip
        """`host`: the host's speed (None: off), multiplied in by sim.clock.StepClock.
        `ranks`: the profile's `tp_ranks` (None: `others_max` stands in). `rho` (with `host`):
        the copula's correlations (module docstring); `spread` then the top-level tables."""
        self.host = host
        self.state: HostSpeed | None = None  # the copula's host state (None: no copula)
        self.rho = [0.0] * len(CPU_PHASES)
        self.ranks = ranks
        if ranks is not None:
            self.ranks_scale = math.exp(float(ranks["intercept"]))
            self.ranks_slope = float(ranks["slope"])
        self.tables = [spread.get(phase) for phase in CPU_PHASES]
        if rho is not None and host is not None:
            self.state, self.host = host, None
            self.rho = [float(rho.get(phase, 0.0)) for phase in CPU_PHASES]
        # the copula's phases (rho > 0 and a table): i -> (rho, sqrt(1 - rho^2), p, ratio)
        self.cop = {
            i: (r, math.sqrt(1.0 - r * r), list(t["p"]), list(t["ratio"]))
            for i, (r, t) in enumerate(zip(self.rho, self.tables, strict=True))
            if r > 0 and t is not None
        }
        self._normals: dict[tuple[int, ...], list[float]] = {}  # e per (phase, block[, n])
        self.key = (int(seed), int(stream))
        self.lo = self.hi = 0
        self.window: list[list[float]] = [[] for _ in CPU_PHASES]
        # `row`'s block: from step rows_lo, per step, every phase's multiplier
        self.rows_lo = -BLOCK_STEPS
        self.rows: list[tuple[float, ...]] = []
        self._blocks: dict[tuple[int, int], list[float]] = {}
        self._others: dict[tuple[int, ...], list[float]] = {}  # others_max's blocks

    def _uniforms(self, tag: tuple[int, ...], shape: int | tuple[int, int]) -> np.ndarray:
        """Uniforms in [0, 1) of the stream seeded with (seed, stream, *tag): every draw here
        is a function of the seed, the stream and the tag alone (module docstring)."""
        import numpy as np

        return np.random.default_rng([*self.key, *tag]).random(shape)

    def _block(self, i: int, b: int) -> list[float]:
        got = self._blocks.get((i, b))
        if got is None:
            table = self.tables[i]
            if table is None:
                got = [1.0] * BLOCK_STEPS
            else:
                got = draw(table, self._uniforms((i, b), BLOCK_STEPS)).tolist()
            self._blocks[(i, b)] = got
        return got

    def ensure(self, first: int, last: int) -> None:
        """Cover steps first .. last (inclusive)."""
        if self.lo <= first and last < self.hi:
            return
        b0, b1 = first // BLOCK_STEPS, last // BLOCK_STEPS
        self._blocks = {k: v for k, v in self._blocks.items() if b0 <= k[1] <= b1}
        for i in range(len(CPU_PHASES)):
            self.window[i] = [x for b in range(b0, b1 + 1) for x in self._block(i, b)]
        self.lo, self.hi = b0 * BLOCK_STEPS, (b1 + 1) * BLOCK_STEPS

    def _keep(self, key: tuple[int, ...], block: list[float]) -> list[float]:
        """Keep a block of a stream beside the phases' (others_max's, ranks_end's) while the
        loop is near it; returns it."""
        if len(self._others) > 64:  # the loop moves forward: old blocks go
            self._others.clear()
        self._others[key] = block
        return block

    def _normal(self, key: tuple[int, ...], u: Any) -> list[float]:
        """The normal scores of a block of uniforms (`u`: a callable giving them), kept by
        `key` ((phase, block, ...)) while the loop is near it."""
        got = self._normals.get(key)
        if got is None:
            # the loop moves forward (a process_outputs looks back at most the depth): the
            # blocks before the previous one go
            b = key[1]
            self._normals = {k: v for k, v in self._normals.items() if k[1] >= b - 1}
            got = self._normals[key] = normal_scores(u())
        return got

    def _phase_e(self, i: int, step: int) -> float:
        """The copula's e of (step, CPU_PHASES[i]): Phi^-1 of the uniform `_block` draws."""
        b = step // BLOCK_STEPS
        u = lambda: self._uniforms((i, b), BLOCK_STEPS)  # noqa: E731
        return self._normal((i, b), u)[step - b * BLOCK_STEPS]

    def _copula(self, i: int, e: float, z: float) -> float:
        """CPU_PHASES[i]'s table at u = Phi(rho z + sqrt(1 - rho^2) e)."""
        r, c, p, ratio = self.cop[i]
        return draw_one(p, ratio, 0.5 * math.erfc(-(r * z + c * e) / math.sqrt(2.0)))

    def row_at(self, step: int, t_s: float) -> list[float]:
        """`row(step)` with the copula's phases drawn at the host's state at `t_s`."""
        m = list(self.row(step))
        if self.cop:
            assert self.state is not None
            z = self.state.z_at(t_s)
            for i in self.cop:
                m[i] = self._copula(i, self._phase_e(i, step), z)
        return m

    def at_time(self, i: int, step: int, t_s: float) -> float:
        """`at(i, step)`, a copula phase drawn at the host's state at `t_s`."""
        if i not in self.cop:
            return self.at(i, step)
        assert self.state is not None
        return self._copula(i, self._phase_e(i, step), self.state.z_at(t_s))

    def others_max(self, i: int, step: int, n: int, t_s: float = 0.0) -> float:
        """The largest of `n` more draws of CPU_PHASES[i]'s multiplier at `step`, independent of
        `at`'s: the same phase on the other tensor-parallel ranks (each its own process). Drawn
        per block of steps from their own stream, so a run stays deterministic. A copula phase:
        at the host's state at `t_s` (the same host), the largest of the ranks' e."""
        b = step // BLOCK_STEPS
        if i in self.cop:
            umax = lambda: self._uniforms((i, b, 1, n), (BLOCK_STEPS, n)).max(axis=1)  # noqa: E731
            assert self.state is not None
            e = self._normal((i, b, 1, n), umax)[step - b * BLOCK_STEPS]
            return self._copula(i, e, self.state.z_at(t_s))
        got = self._others.get((i, b, n))
        if got is None:
            table = self.tables[i]
            if table is None:
                block = [1.0] * BLOCK_STEPS
            else:
                u = self._uniforms((i, b, 1, n), (BLOCK_STEPS, n))
                block = draw(table, u).max(axis=1).tolist()
            got = self._keep((i, b, n), block)
        return got[step - b * BLOCK_STEPS]

    def ranks_end(self, step: int, own: float) -> float:
        """Where the last worker rank's launch of `step` ends, from rank 0's launch start in
        rank 0's launches (> 1: after rank 0's), at rank 0's launch multiplier `own` (module
        docstring). The residual from its own stream, per block of steps: deterministic,
        whatever asks first."""
        b = step // BLOCK_STEPS
        got = self._others.get((-1, b, 2))
        if got is None:
            assert self.ranks is not None, "ranks_end without a tp_ranks fit"
            u = self._uniforms((2**31, b, 2), BLOCK_STEPS)
            got = self._keep((-1, b, 2), draw(self.ranks["residual"], u).tolist())
        return self.ranks_scale * own**self.ranks_slope * got[step - b * BLOCK_STEPS]

    def at(self, i: int, step: int) -> float:
        """The multiplier of CPU_PHASES[i] at `step`."""
        if not self.lo <= step < self.hi:
            # the loop moves forward; a process_outputs looks back at most the depth
            self.ensure(max(0, step - 64), step)
        return self.window[i][step - self.lo]

    def row(self, step: int) -> tuple[float, ...]:
        """Every phase's multiplier at `step`, in CPU_PHASES order: `at(i, step)` for each i,
        in one call (a step's launch phases read five of them)."""
        j = step - self.rows_lo
        if not 0 <= j < BLOCK_STEPS:  # the loop moves forward: the next block's rows
            b = step // BLOCK_STEPS
            phases = [self._block(i, b) for i in range(len(CPU_PHASES))]
            self.rows = list(zip(*phases, strict=True))
            self.rows_lo = b * BLOCK_STEPS
            j = step - self.rows_lo
        return self.rows[j]


def phase_spread(profile: Mapping[str, Any], seed: int, stream: int = 0) -> PhaseSpread | None:
    """The multipliers of a resolved profile's `cpu_spread` and `host_speed`, or None when it
    has neither."""
    spread = profile.get(SPREAD_KEY) or {}
    host = host_speed(profile, seed, stream)
    rho = None
    if host is not None:
        rho = profile[HOST_KEY].get(RHO_KEY)
        if rho is None:  # the product: the spread around the host's speed
            spread = profile[HOST_KEY].get(SPREAD_KEY, spread)
    ranks = profile.get(RANKS_KEY)
    if not spread and host is None and ranks is None:
        return None
    return PhaseSpread(spread, seed, stream, host, ranks, rho)
