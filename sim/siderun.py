"""The extra runs of `sim run --seeds N` and `--host-band`: the same trace under other configs,
each without step records into a temporary folder, of which only the summary is kept.

With `jobs` > 1 they go to a pool of that many processes as they are added, before the main run
starts, so they run beside it; `results` then waits for them. With one job they run one after
another in this process, when `results` is called (after the main run). Either way each run is
a function of its config alone, so the summaries, and what the caller adds to summary.json from
them, are the same whatever `jobs` is (tests/test_sim_siderun.py).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

from bubblesim.core.cli import finished, raise_if_terminated, sigterm_deferred
from bubblesim.core.config import Config
from bubblesim.core.scenario import Scenario

Summary = dict[str, Any]


def side_summary(cfg: Config, trace: str, folder: str, scenario: Scenario | None) -> Summary:
    """One extra run (in a pool worker or here): its summary."""
    from sim.run import simulate

    return simulate(cfg, trace, Path(folder), steps=False, scenario=scenario).summary


class SideRuns:
    """Extra runs of one trace, added by `add(label, config)` and read back in that order by
    `results`. A context manager: its temporary folder (`folder`, also for files the configs
    name) and its pool go at the exit; on an error there, runs not yet started are cancelled."""

    def __init__(self, trace: str, scenario: Scenario | None, jobs: int, total: int) -> None:
        """`total`: how many runs will be added (the pool's size is min(jobs, total))."""
        if jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {jobs}")
        self.trace = trace
        self.scenario = scenario
        self._tmp: tempfile.TemporaryDirectory[str] | None = None  # made by the first `folder`
        workers = min(jobs, total)
        self._pool = ProcessPoolExecutor(max_workers=workers) if workers > 1 else None
        self._runs: list[tuple[str, Config, Future[Summary] | None, float]] = []

    def __enter__(self) -> SideRuns:
        return self

    @property
    def folder(self) -> Path:
        """The runs' temporary folder (made when first asked for; removed at the exit)."""
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="sim-side-")
        return Path(self._tmp.name)

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=kind is not None)
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    def add(self, label: str, cfg: Config) -> None:
        """A run of the trace under `cfg`; with a pool it is submitted now."""
        i = len(self._runs)
        fut = None
        if self._pool is not None:
            folder = str(self.folder / f"run{i}")
            with sigterm_deferred():  # a submit holds the pool's lock: SIGTERM raised after it
                fut = self._pool.submit(side_summary, cfg, self.trace, folder, self.scenario)
            raise_if_terminated()
        self._runs.append((label, cfg, fut, time.monotonic()))

    def results(self, say: Callable[[str], None] | None) -> list[Summary]:
        """Every run's summary, in the order added; `say` gets a line per run (serial: before
        it, with a pool: as it ends, with the seconds since it was added)."""
        if self._pool is None:
            out = []
            for i, (label, cfg, _, _) in enumerate(self._runs):
                if say is not None:
                    say(label)
                out.append(side_summary(cfg, self.trace, str(self.folder / f"run{i}"),
                                        self.scenario))  # fmt: skip
            return out
        return self._gather(say)

    def _gather(self, say: Callable[[str], None] | None) -> list[Summary]:
        """Wait for the pool's runs; a run's error is raised as soon as it is seen."""
        futures = [fut for _, _, fut, _ in self._runs if fut is not None]
        got: dict[int, Summary] = {}

        def each(i: int, summary: Summary) -> None:
            got[i] = summary
            if say is not None:
                label, _, _, t0 = self._runs[i]
                say(f"{label}: done ({time.monotonic() - t0:.1f} s)")

        finished(futures, each)
        return [got[i] for i in range(len(self._runs))]
