"""What a sweep worker runs for one point: a plain function of a picklable task dict, the same
in the driver (serial), a local process pool and a Ray worker. Traces are read once per worker
process and kept by sha256."""

from __future__ import annotations

import ctypes
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bubblesim.core.config import from_dict
from bubblesim.core.trace import Trace, read_trace, trace_sha256
from bubblesim.plan.fleet import FleetSpec, simulate_fleet
from bubblesim.plan.points import Point, jsonable
from bubblesim.plan.spec import SLO

_TRACES: dict[str, Trace] = {}
_TUNED = False

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MIB = 1 << 20


def tune_allocator() -> None:
    """Once per worker process (glibc only; elsewhere nothing): keep freed memory for the next
    point instead of handing it back to the OS. A point allocates and frees hundreds of MB
    (step columns, the frozen recording); fresh pages fault in one by one, which costs ~6 % of
    a sweep's CPU time on a small VM (bench/plan_sweep.py). Allocations up to 32 MiB come from
    the heap, which is trimmed only past 2 GiB free. Results do not change: only where memory
    comes from."""
    global _TUNED
    if _TUNED:
        return
    _TUNED = True
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: libc's among them
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc (musl has no mallopt): the defaults stay
    mallopt(_M_MMAP_THRESHOLD, 32 * _MIB)  # glibc's largest
    mallopt(_M_TRIM_THRESHOLD, 2047 * _MIB)
    mallopt(_M_TOP_PAD, 256 * _MIB)


def make_task(
    key: str, point: Point, trace_path: str, trace_sha: str, slos: tuple[SLO, ...], early: bool
) -> dict[str, Any]:
    return {
        "key": key,
        "point": point,
        "trace_path": trace_path,
        "trace_sha": trace_sha,
        "slos": slos,
        "early_stop": early,
    }


def _trace(path: str, sha: str, data: bytes | None) -> Trace:
    """The trace with this sha256: from `path` when it holds it, else from `data` (a Ray
    worker on another host gets the file's bytes)."""
    got = _TRACES.get(sha)
    if got is not None:
        return got
    if not (Path(path).is_file() and trace_sha256(path) == sha):
        if data is None:
            raise FileNotFoundError(f"trace '{path}' with sha256 {sha[:12]} is not on this host")
        with tempfile.TemporaryDirectory(prefix="bubblesim-trace-") as d:
            tmp = Path(d) / "trace.parquet"  # read whole into memory, then removed
            tmp.write_bytes(data)
            trace = _TRACES[sha] = read_trace(tmp)
        return trace
    trace = _TRACES[sha] = read_trace(path)
    return trace


def run_task(task: dict[str, Any], trace_bytes: bytes | None = None) -> dict[str, Any]:
    tune_allocator()
    point: Point = task["point"]
    trace = _trace(task["trace_path"], task["trace_sha"], trace_bytes)
    spec = FleetSpec(
        from_dict(point.config),
        point.replicas,
        point.router,
        point.load_factor,
        point.prefix_abs_tokens,
        point.prefix_rel,
    )
    t0, c0 = time.perf_counter(), time.process_time()
    result = simulate_fleet(spec, trace, task["slos"], task["early_stop"])
    wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    result["sim"].pop("wall_s", None)  # the result is what the point determines; timing apart
    return {"key": task["key"], "result": jsonable(result), "wall_s": wall_s, "cpu_s": cpu_s}
