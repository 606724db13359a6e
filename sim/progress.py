"""Progress of a long command on stderr: how far, how long still, and what it is doing now.

On a terminal: one line, redrawn at most 10 times a second and erased at the end. Anywhere else
(a log file, a CI job, a pipe): a plain line now and then instead of a redrawn bar, when the
work crosses a tenth of its total or `log_every_s` of wall time passed, whichever comes first,
but never within `min_gap_s` of the previous line and never in the first `min_gap_s` seconds,
so a run that takes a second prints nothing. `enabled=False` (`-q`) prints nothing at all.

The owner calls `update(done)` as often as it likes: a call costs one clock read (the sim calls
it at step or fast-forward segment ends, never inside a segment); `phase(name)` names what runs
after the counted work (e.g. "writing run folder").
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from sim.loop import SimLoop

REDRAW_S = 0.1  # terminal: at most 10 redraws a second


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


class Progress:
    def __init__(
        self,
        label: str,
        total: float,
        unit: str = "",
        enabled: bool = True,
        stream: TextIO | None = None,
        tty: bool | None = None,
        log_every_s: float = 10.0,
        min_gap_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`total`: the amount of work `update` counts towards (in `unit`, e.g. "s simulated")."""
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty() if tty is None else tty
        self.log_every_s = log_every_s
        self.min_gap_s = min_gap_s
        self.clock = clock
        self.t0 = clock()
        self.done = 0.0
        self.note = ""  # extra text after the numbers (e.g. "draining 120 requests")
        self._phase = ""
        self._eta_s: float | None = None
        self._last_draw = -float("inf")
        self._last_log = self.t0  # no log line in the first min_gap_s
        self._logged_tenth = 0  # tenths of the total already announced in the log
        self._drawn = False

    # ---- what the owner calls -----------------------------------------------------------------
    def update(self, done: float, note: str = "", eta_s: float | None = None) -> None:
        """`eta_s`: the owner's own estimate of the wall time left (else from the rate so far)."""
        if not self.enabled:
            return
        self.done, self.note, self._eta_s = done, note, eta_s
        now = self.clock()
        if self.tty:
            if now - self._last_draw >= REDRAW_S:
                self._draw(now)
            return
        tenth = int(10 * self.fraction())
        gap = now - self._last_log
        if gap >= self.min_gap_s and (tenth > self._logged_tenth or gap >= self.log_every_s):
            self._logged_tenth = tenth
            self._log(now, self.text(now))

    def phase(self, name: str) -> None:
        """The counted work is over; `name` runs now (shown until the next phase or close)."""
        if not self.enabled:
            return
        self._phase = name
        now = self.clock()
        if self.tty:
            self._draw(now)
        elif now - self.t0 >= self.min_gap_s:  # a long command: say where its time goes
            self._log(now, f"{self.label}: {name} ({_duration(now - self.t0)} elapsed)")

    def close(self) -> None:
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()

    # ---- the text -----------------------------------------------------------------------------
    def fraction(self) -> float:
        if self.total <= 0:
            return 1.0 if self.done >= self.total else 0.0
        return min(1.0, self.done / self.total)

    def eta_s(self, now: float) -> float | None:
        """Wall seconds left, from the rate so far (None before any work is counted)."""
        if self._eta_s is not None:
            return self._eta_s
        f = self.fraction()
        elapsed = now - self.t0
        if f < 0.01 or f >= 1 or elapsed < 1.0:
            return None  # too little to go on, or past the counted work (the owner knows more)
        return elapsed * (1 - f) / f

    def text(self, now: float) -> str:
        if self._phase:
            return f"{self.label}: {self._phase} ({_duration(now - self.t0)} elapsed)"
        eta = self.eta_s(now)
        left = f", ~{_duration(eta)} left" if eta is not None else ""
        note = f", {self.note}" if self.note else ""
        return (
            f"{self.label}: {self.done:,.0f} of {self.total:,.0f}{self.unit} "
            f"({100 * self.fraction():.0f} %){note}, {_duration(now - self.t0)} elapsed{left}"
        )

    def _draw(self, now: float) -> None:
        self._last_draw = now
        self._drawn = True
        self.stream.write(f"\r\033[K{self.text(now)}")
        self.stream.flush()

    def _log(self, now: float, line: str) -> None:
        self._last_log = now
        self.stream.write(line + "\n")
        self.stream.flush()


class LoopProgress:
    """The simulator's step hook (`SimLoop.progress`): simulated time out of the trace's arrival
    span, then, past the last arrival, the requests still in the engine while it drains.

    SimLoop calls it after each step it completes one by one and at the end of each fast-forward
    segment, never inside one. It looks again after max(arrival span, simulated time so far) /
    `ticks`, and at least `min_tick_s`, of simulated time: it sets `SimLoop.tick_at_s` there, so
    a long fast-forward segment ends at that step (a segment boundary changes nothing in the
    run, tests/test_cli_feedback.py), and returns at once when called earlier. So a run gets a
    few hundred looks, whatever its length, and long segments stay long."""

    def __init__(self, bar: Progress, ticks: int = 200, min_tick_s: float = 1.0) -> None:
        self.bar = bar
        self.ticks = ticks
        self.min_tick_s = min_tick_s
        self.loop: SimLoop | None = None
        self._drain: tuple[float, int] | None = None  # (wall clock, requests left) at its start

    def attach(self, loop: SimLoop) -> None:
        self.loop = loop
        loop.tick_at_s = 0.0  # the first call looks

    def __call__(self, step: int) -> None:
        loop = self.loop
        if loop is None or loop.cpu_s < loop.tick_at_s:
            return
        bar = self.bar
        tick_s = max(bar.total, loop.cpu_s) / self.ticks
        loop.tick_at_s = loop.cpu_s + max(tick_s, self.min_tick_s)
        if loop.cpu_s < bar.total:
            bar.update(loop.cpu_s)
            return
        sched = loop.sched
        left = len(loop.requests) - loop.num_arrived + len(sched.waiting) + len(sched.running)
        now = bar.clock()
        if self._drain is None:
            self._drain = (now, left)
        t_d, left_d = self._drain
        eta = left * (now - t_d) / (left_d - left) if left_d > left else None
        bar.update(bar.total, f"draining: {left:,} requests left", eta)
