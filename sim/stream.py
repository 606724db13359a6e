"""The GPU stream: passes run in launch order, one at a time."""

from __future__ import annotations

from collections.abc import Mapping


class IdleStart:
    """How much shorter a CUDA graph runs when issued to an idle GPU than queued behind other
    work (profile `gpu_pass.idle_start`; sim.cost.defaults says what was measured). A gap of
    `idle_s` > `min_s` shortens a pass of `gpu_s` to `shorten(gpu_s, idle_s)`:
    - the shrink law (`per_s` > 0): by min(per_s x (idle_s - after_s), max_fraction x gpu_s);
    - else the ratio law: `scale` x gpu_s.
    The defaults change nothing."""

    __slots__ = ("min_s", "scale", "per_s", "after_s", "max_fraction")

    def __init__(
        self, min_s: float = 0.0, scale: float = 1.0, per_s: float = 0.0, after_s: float = 0.0,
        max_fraction: float = 0.0,
    ) -> None:  # fmt: skip
        self.min_s = min_s
        self.scale = scale
        self.per_s = per_s  # seconds saved per second of idle beyond after_s
        self.after_s = after_s
        self.max_fraction = max_fraction

    @classmethod
    def from_table(cls, t: Mapping[str, float], verify: bool = False) -> IdleStart:
        """From a profile's `gpu_pass.idle_start` table (milliseconds). `verify`: the graphs
        are speculative decoding's verify passes, which take the `verify_` shrink law (none
        when it was not fitted). The ratio law (`scale`) is in force only while no shrink law
        is fitted, and then covers both."""
        law = "verify_shrink" if verify else "shrink"
        fitted = float(t.get("shrink_per_ms", 0.0)) > 0.0
        return cls(
            float(t["min_idle_ms"]) / 1e3, 1.0 if fitted else float(t["scale"]),
            float(t.get(f"{law}_per_ms", 0.0)), float(t.get(f"{law}_after_ms", 0.0)) / 1e3,
            float(t.get(f"{law}_max_fraction", 0.0)),
        )  # fmt: skip

    @property
    def acts(self) -> bool:
        return self.per_s > 0.0 or self.scale != 1.0

    def shorten(self, gpu_s: float, idle_s: float) -> float:
        if self.per_s > 0.0:
            saved = self.per_s * (idle_s - self.after_s)
            if saved <= 0.0:
                return gpu_s
            cap = self.max_fraction * gpu_s
            return gpu_s - (saved if saved < cap else cap)
        return gpu_s * self.scale


NO_IDLE_EFFECT = IdleStart()


def gpu_pass(
    launch_s: float, ready_s: float, free_s: float, gpu_s: float, graphed: bool,
    idle: IdleStart = NO_IDLE_EFFECT, eager_lag_s: float = 0.0,
) -> tuple[float, float]:  # fmt: skip
    """(start, end) of a forward pass on the in-order stream. A CUDA graph starts once its
    replay is issued; eager kernels start as the first is issued and the pass cannot end before
    the last is (the stream's busy interval, as the engine's CUDA events measure it). A graph
    issued to a GPU idle for more than `idle.min_s` runs `idle.shorten(gpu_s, idle_s)`
    (measured: such decode graphs run up to ~half shorter than ones queued behind the previous
    step, more the longer the GPU sat idle). An eager pass ends `eager_lag_s` after its last
    issue at the earliest (profile `launch.eager_lag_ms`)."""
    if graphed:
        if ready_s > free_s:
            if ready_s - free_s > idle.min_s:
                gpu_s = idle.shorten(gpu_s, ready_s - free_s)
            return ready_s, ready_s + gpu_s
        return free_s, free_s + gpu_s
    start = launch_s if launch_s > free_s else free_s
    end = start + gpu_s
    if eager_lag_s:  # the tail past the last issue (other tensor-parallel ranks' own launch)
        ready_s += eager_lag_s
    return start, end if end > ready_s else ready_s
