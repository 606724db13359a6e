"""Sweep points: what one simulation is, its key, and the append-only file of finished ones.

A point's key is the sha256 of its fleet spec (full config, router, replicas, load factor),
the trace's sha256, the cost profile's sha256 (when the config names one) and the code version
(a hash of the simulator's sources). A rerun finds a point's record in DIR/points.jsonl and
skips it: a complete record serves any SLOs; a record stopped early serves SLOs that include
the one it was stopped for at the same or a tighter limit (the verdict is then the same).

points.jsonl: one JSON object per line, `{"key", "point", "result", "wall_s", "cpu_s"}` (and
`same_as`: the key of the run that answered it, bubblesim.plan.sweep), appended by one writer (the
driver) with a single write each; a torn last line (a killed run) is ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bubblesim.plan.spec import SLO

ROOT = Path(__file__).resolve().parents[2]
# Sources whose change can change a point's result (the report and CLI cannot).
_CODE_DIRS = ("bubblesim/core", "sim")
_NOT_RESULT = (
    "bubblesim/plan/report.py",
    "bubblesim/core/svg.py",
    "bubblesim/plan/cli.py",
    "bubblesim/plan/sweep.py",
)


@dataclass(frozen=True)
class Point:
    config: dict[str, Any]  # Config.to_dict()
    replicas: int
    load_factor: float
    router: str
    prefix_abs_tokens: int = 4096
    prefix_rel: float = 1.5

    def canonical(self) -> dict[str, Any]:
        """The fields that change the result: a lone replica has no router."""
        d = asdict(self)
        if self.replicas == 1:
            d.update(router="-", prefix_abs_tokens=0, prefix_rel=0.0)
        elif self.router != "prefix-aware":
            d.update(prefix_abs_tokens=0, prefix_rel=0.0)
        return d


def round_factor(x: float) -> float:
    """Load factors on a 4-significant-digit grid, so keys are stable across searches."""
    return float(f"{x:.4g}")


_code_version: str | None = None


def code_version() -> str:
    global _code_version
    if _code_version is None:
        h = hashlib.sha256()
        for d in _CODE_DIRS:
            for p in sorted((ROOT / d).rglob("*.py")):
                rel = p.relative_to(ROOT).as_posix()
                if rel in _NOT_RESULT:
                    continue
                h.update(rel.encode() + b"\0" + p.read_bytes() + b"\0")
        _code_version = h.hexdigest()[:16]
    return _code_version


def point_key(point: Point, trace_sha: str, profile_sha: str = "") -> str:
    blob = json.dumps(
        {"p": point.canonical(), "t": trace_sha, "c": code_version(), "prof": profile_sha},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def serves(result: dict[str, Any], slos: tuple[SLO, ...]) -> bool:
    """Whether a stored result answers a plan with these SLOs."""
    stopped = result.get("stopped")
    if not stopped:
        return True
    return any(s.key == stopped["slo"] and s.limit_s <= stopped["limit_s"] for s in slos)


def jsonable(x: Any) -> Any:
    """NaN/inf -> None, tuples -> lists, numpy scalars -> Python: strict JSON."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, str | bytes):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class PointStore:
    """DIR/points.jsonl: records by key (the last record of a key wins)."""

    def __init__(self, path: Path, resume: bool = True) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        if resume and path.is_file():
            _drop_torn_tail(path)
            for rec in _read_lines(path):
                self.records[rec["key"]] = rec
        elif path.exists():
            path.unlink()
        self.earlier = frozenset(self.records)  # keys found from an earlier run

    def get(self, key: str, slos: tuple[SLO, ...]) -> dict[str, Any] | None:
        rec = self.records.get(key)
        if rec is None or not serves(rec["result"], slos):
            return None
        return rec

    def add(
        self,
        key: str,
        point: Point,
        result: dict[str, Any],
        wall_s: float,
        cpu_s: float | None = None,
        same_as: str | None = None,
    ) -> None:
        rec = {
            "key": key,
            "point": asdict(point),
            "result": jsonable(result),
            "wall_s": wall_s,
            "cpu_s": cpu_s,
        }
        if same_as is not None:  # answered by the run of this point (bubblesim.plan.sweep)
            rec["same_as"] = same_as
        line = json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write of one line: O_APPEND keeps it whole
        finally:
            os.close(fd)
        self.records[key] = rec


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a killed write), so appends start a fresh line."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _read_lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn line from a killed run
            if isinstance(rec, dict) and "key" in rec and "result" in rec:
                yield rec
