"""Run sweep points somewhere: in this process, a local process pool, or a Ray cluster, and
drive searches that ask for points as they learn.

A search is a generator (bubblesim.plan.search) that yields a list of points and is sent back their
results in the same order. The driver keeps every worker busy with the points of all searches
at once; each search sees only its own results, so what it finds does not depend on who ran
the points or in which order they finished. Finished points are appended to the store at
once; points the store already holds are not run again.

Same runs: `max_num_seqs` is read only where the scheduler admits a request (admit while fewer
than it run). A run whose replicas never had that many requests running (`sim.peak_running`
below the point's max_num_seqs) never met the limit, so it is, step for step, the run of the
same point with any max_num_seqs above its peak. Points that differ only there form a family:
one runs at a time (the largest limit first), and a finished run answers the others it
covers, recorded with `same_as` and no CPU time. `reuse=False` runs every point.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bubblesim.plan.points import Point, PointStore, point_key, serves
from bubblesim.plan.spec import SLO, PlanError
from bubblesim.plan.worker import make_task, run_task

Search = Generator[list[Point], list[dict[str, Any]], Any]


class Executor(Protocol):
    def submit(self, task: dict[str, Any]) -> None: ...

    def next_done(self) -> dict[str, Any]:
        """Block until some submitted task is done; its output (run_task's dict)."""
        ...

    def close(self) -> None: ...


class SerialExecutor:
    def __init__(self) -> None:
        self.queue: deque[dict[str, Any]] = deque()

    def submit(self, task: dict[str, Any]) -> None:
        self.queue.append(task)

    def next_done(self) -> dict[str, Any]:
        return run_task(self.queue.popleft())

    def close(self) -> None:
        self.queue.clear()


class PoolExecutor:
    """A local process pool (fork where available: workers start in milliseconds)."""

    def __init__(self, jobs: int) -> None:
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else None)
        self.pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx)
        self.pending: set[cf.Future[dict[str, Any]]] = set()
        self.done: deque[cf.Future[dict[str, Any]]] = deque()

    def submit(self, task: dict[str, Any]) -> None:
        self.pending.add(self.pool.submit(run_task, task))

    def next_done(self) -> dict[str, Any]:
        finished: set[cf.Future[dict[str, Any]]] = set()
        while not self.done and not finished and self.pending:
            # woken twice a second: a signal handler (SIGTERM) runs only in the main thread,
            # and only once it wakes up
            finished, self.pending = cf.wait(
                self.pending, timeout=0.5, return_when=cf.FIRST_COMPLETED
            )
        # several may finish together: hand them out in submission-independent key order
        self.done.extend(sorted(finished, key=lambda f: f.result()["key"]))
        return self.done.popleft().result()

    def close(self) -> None:
        for f in self.pending:
            f.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)


class RayExecutor:
    """Points as Ray tasks. ADDRESS: `local` starts a local cluster; anything else goes to
    `ray.init(address=...)` (`auto`, `ray://host:10001`). The `bubblesim` and `sim` packages travel
    with the job (runtime_env py_modules) and the trace as bytes in the object store, so
    workers need neither this checkout nor the trace file."""

    def __init__(self, address: str, trace_path: str) -> None:
        try:
            import ray
        except ModuleNotFoundError:
            raise PlanError("--ray needs the 'ray' package: pip install 'ray>=2.9'") from None
        self.ray = ray
        root = Path(__file__).resolve().parents[2]
        env = {"py_modules": [str(root / "bubblesim"), str(root / "sim")]}
        if not ray.is_initialized():
            try:
                if address == "local":
                    ray.init(
                        num_cpus=os.cpu_count(),
                        include_dashboard=False,
                        log_to_driver=False,
                        runtime_env=env,
                    )
                else:
                    ray.init(address=address, log_to_driver=False, runtime_env=env)
            except (ValueError, ConnectionError, RuntimeError) as e:
                raise PlanError(_ray_refusal(address, e)) from None
        self.trace_ref = ray.put(Path(trace_path).read_bytes())
        self.remote = ray.remote(run_task)
        self.pending: list[Any] = []

    def submit(self, task: dict[str, Any]) -> None:
        self.pending.append(self.remote.remote(task, self.trace_ref))

    def next_done(self) -> dict[str, Any]:
        ready, self.pending = self.ray.wait(self.pending, num_returns=1)
        out: dict[str, Any] = self.ray.get(ready[0])
        return out

    def close(self) -> None:
        for ref in self.pending:
            self.ray.cancel(ref)
        self.pending = []


def _ray_refusal(address: str, e: Exception) -> str:
    """One line for a failed ray.init: Ray's first line, and the way out."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if address == "local" and "existing cluster" in str(e):
        return (
            f"--ray local: a Ray cluster already runs here ({first}); join it with --ray auto, "
            "or stop it with `ray stop`"
        )
    return f"--ray {address}: Ray could not start or connect: {first}"


def make_executor(jobs: int, ray_address: str | None, trace_path: str) -> Executor:
    if ray_address:
        return RayExecutor(ray_address, trace_path)
    if jobs <= 1:
        return SerialExecutor()
    return PoolExecutor(jobs)


@dataclass
class SweepStats:
    run: int = 0
    cached: int = 0  # found in the store from an earlier run
    repeated: int = 0  # asked again in this run (the store answered)
    shared: int = 0  # asked while already running, run once
    same: int = 0  # answered by the run of a point that differs only in an unmet max_num_seqs
    wall_s_sum: float = 0.0
    cpu_s_sum: float = 0.0  # CPU seconds the points took (wall_s also counts waiting for a core)
    wall_s: list[float] = field(default_factory=list)


@dataclass
class _Asker:
    name: Hashable
    gen: Search
    points: list[Point]
    results: list[dict[str, Any] | None]
    missing: int


class Driver:
    def __init__(
        self,
        executor: Executor,
        store: PointStore,
        trace_path: str,
        trace_sha: str,
        slos: tuple[SLO, ...],
        early_stop: bool = True,
        profile_sha: Callable[[Point], str] = lambda p: "",
        progress: Callable[[SweepStats, int], None] | None = None,
        reuse: bool = True,
    ) -> None:
        self.ex = executor
        self.store = store
        self.trace_path, self.trace_sha = trace_path, trace_sha
        self.slos, self.early = slos, early_stop
        self.profile_sha = profile_sha
        self.progress = progress
        self.stats = SweepStats()
        self.waiting: dict[str, list[tuple[_Asker, int]]] = {}  # key -> who needs it
        self.inflight = 0
        self.reuse = reuse
        # family -> finished runs that never met their max_num_seqs: (peak running, record)
        self.unbound: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self.fam_running: dict[str, str] = {}  # family -> key of its point being run
        self.held: dict[str, list[tuple[str, Point]]] = {}  # family -> points not yet run
        if reuse:
            for rec in store.records.values():
                self._index(Point(**rec["point"]), rec)

    def run(self, searches: dict[Hashable, Search]) -> dict[Hashable, Any]:
        """Drive every search to its end; returns each one's return value."""
        self.outcome: dict[Hashable, Any] = {}
        try:
            fresh = deque(self._step(name, gen, None) for name, gen in searches.items())
            self._ask(fresh)
            while self.inflight:
                out = self.ex.next_done()
                self.inflight -= 1
                self._ask(self._finished(out))
        finally:
            self.ex.close()
        return self.outcome

    def _step(self, name: Hashable, gen: Search, results: list[Any] | None) -> _Asker | None:
        """The search's next request (None when it is done: its outcome is recorded)."""
        try:
            pts = next(gen) if results is None else gen.send(results)
        except StopIteration as stop:
            self.outcome[name] = stop.value
            return None
        return _Asker(name, gen, pts, [None] * len(pts), len(pts))

    def _ask(self, fresh: deque[_Asker | None]) -> None:
        """Ask for the points of new requests; a request whose points are all known (cached)
        is answered at once and the search goes on."""
        while fresh:
            a = fresh.popleft()
            if a is None:
                continue
            for i, p in enumerate(a.points):
                self._need(a, i, p)
            if a.missing == 0:
                fresh.append(self._step(a.name, a.gen, a.results))
        self._release_held()

    def _need(self, a: _Asker, i: int, p: Point) -> None:
        key = point_key(p, self.trace_sha, self.profile_sha(p))
        rec = self.store.get(key, self.slos)
        if rec is not None:
            if key in self.store.earlier:
                self.stats.cached += 1
            else:
                self.stats.repeated += 1
            a.results[i] = {
                **rec["result"],
                "wall_s": rec["wall_s"],
                "key": key,
                "cpu_s": rec.get("cpu_s"),
            }
            a.missing -= 1
            return
        if key in self.waiting:
            self.stats.shared += 1
            self.waiting[key].append((a, i))
            return
        self.waiting[key] = [(a, i)]
        fam = self._family(p)
        if fam is None:
            self._submit(key, p)
            return
        same = self._same_run(fam, p)
        if same is not None:
            self._answer_same(key, p, same)  # a.missing drops; _ask steps the search
        else:
            self.held.setdefault(fam, []).append((key, p))  # run by _release_held

    def _submit(self, key: str, p: Point) -> None:
        self.ex.submit(make_task(key, p, self.trace_path, self.trace_sha, self.slos, self.early))
        self.inflight += 1

    # ---- same runs ----------------------------------------------------------------------------
    def _family(self, p: Point) -> str | None:
        """The key of the point with max_num_seqs left out (None when reuse is off)."""
        if not self.reuse or "max_num_seqs" not in p.config:
            return None
        q = dataclasses.replace(p, config={**p.config, "max_num_seqs": 0})
        return point_key(q, self.trace_sha, self.profile_sha(p))

    def _index(self, p: Point, rec: dict[str, Any]) -> None:
        """Remember a finished run if it never met its max_num_seqs."""
        fam = self._family(p)
        peak = rec["result"].get("sim", {}).get("peak_running")
        if fam is not None and peak is not None and peak < p.config["max_num_seqs"]:
            self.unbound.setdefault(fam, []).append((peak, rec))

    def _same_run(self, fam: str, p: Point) -> dict[str, Any] | None:
        """A finished run of the family that is this point's run, or None."""
        for peak, rec in self.unbound.get(fam, ()):
            if peak < p.config["max_num_seqs"] and serves(rec["result"], self.slos):
                return rec
        return None

    def _answer_same(self, key: str, p: Point, rec: dict[str, Any]) -> deque[_Asker | None]:
        """Record the point with the run `rec` and answer who waits for it; returns the
        searches to step (those it completes)."""
        self.store.add(key, p, rec["result"], 0.0, 0.0, same_as=rec["key"])
        self.stats.same += 1
        nxt: deque[_Asker | None] = deque()
        for a, i in self.waiting.pop(key):
            a.results[i] = {**rec["result"], "wall_s": 0.0, "key": key, "cpu_s": 0.0}
            a.missing -= 1
            if a.missing == 0:
                nxt.append(a)
        return nxt

    def _release_held(self) -> None:
        """Run one held point per family that has none running: the largest max_num_seqs,
        whose run covers every other with a limit above its peak."""
        for fam, held in self.held.items():
            if held and fam not in self.fam_running:
                held.sort(key=lambda kp: kp[1].config["max_num_seqs"])
                key, p = held.pop()
                self.fam_running[fam] = key
                self._submit(key, p)

    def _settle_family(self, key: str, point: Point) -> deque[_Asker | None]:
        """A family's run finished: answer the held points it covers."""
        fam = self._family(point)
        nxt: deque[_Asker | None] = deque()
        if fam is None or self.fam_running.get(fam) != key:
            return nxt
        del self.fam_running[fam]
        self._index(point, self.store.records[key])
        keep = []
        for k2, p2 in self.held.get(fam, ()):
            same = self._same_run(fam, p2)
            if same is None:
                keep.append((k2, p2))
                continue
            for a in self._answer_same(k2, p2, same):
                if a is not None:
                    nxt.append(self._step(a.name, a.gen, a.results))
        self.held[fam] = keep
        return nxt

    def _finished(self, out: dict[str, Any]) -> deque[_Asker | None]:
        key = out["key"]
        askers = self.waiting.pop(key)
        point = askers[0][0].points[askers[0][1]]
        self.store.add(key, point, out["result"], out["wall_s"], out.get("cpu_s"))
        self.stats.run += 1
        self.stats.wall_s_sum += out["wall_s"]
        self.stats.cpu_s_sum += out.get("cpu_s", 0.0)
        self.stats.wall_s.append(out["wall_s"])
        nxt: deque[_Asker | None] = deque()
        for a, i in askers:
            a.results[i] = {
                **out["result"],
                "wall_s": out["wall_s"],
                "key": key,
                "cpu_s": out.get("cpu_s"),
            }
            a.missing -= 1
            if a.missing == 0:
                nxt.append(self._step(a.name, a.gen, a.results))
        nxt.extend(self._settle_family(key, point))
        if self.progress is not None:
            self.progress(self.stats, self.inflight)
        return nxt
