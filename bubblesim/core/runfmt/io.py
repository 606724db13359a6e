"""Write a run folder atomically (Contract 3) and read one back.

`write_run` builds every file into a temp folder next to the target, then renames it into
place; a previous run folder at the target is replaced (moved aside, then deleted), anything
else there is refused. An exception at any point removes the temp folder: the target is left
as it was, never half-written.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bubblesim.core.atomic import swap_in, temp_dir
from bubblesim.core.runfmt import codec
from bubblesim.core.runfmt.bubbles import Bubbles, account_bubbles
from bubblesim.core.runfmt.recording import Recording, validate
from bubblesim.core.runfmt.records import RunRecorder
from bubblesim.core.runfmt.spill import release
from bubblesim.core.runfmt.summary import FORMAT, READ_VERSIONS, REQUIRED_KEYS, build_summary
from bubblesim.core.runfmt.tables import (
    GC_COLUMNS,
    REQUEST_COLUMNS,
    STEP_COLUMNS,
    gc_table,
    requests_table,
    steps_table,
    sync_in_order,
)
from bubblesim.core.runfmt.timeline import DEFAULT_MAX_STEPS, build_timeline, window

SUMMARY, REQUESTS, STEPS, GC_PAUSES, TIMELINE = (
    "summary.json",
    "requests.parquet",
    "steps.parquet",
    "gc.parquet",
    "timeline.json",
)
RUN_FILES: tuple[str, ...] = (SUMMARY, REQUESTS, STEPS, GC_PAUSES, TIMELINE)
# Step columns added to format version 1 after run folders were written with it (int64 shape
# fields). A folder without one reads it as zeros, in its STEP_COLUMNS place, and names it in
# `Run.filled`: the value was never recorded (0 is not a measurement; `max_kv_tokens` cannot be
# rebuilt from the sums the folder keeps), so anything that fits or compares it must skip it.
ADDED_STEP_COLUMNS: tuple[str, ...] = ("max_kv_tokens",)


class RunFormatError(ValueError):
    """A folder that is not a (readable) run, or bad arguments to write_run."""


def trace_info(path: str | Path) -> dict[str, Any]:
    """{path, sha256, rows} of a trace parquet file, for summary.json's `trace`."""
    p = Path(path)
    digest = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {
        "path": str(p),
        "sha256": digest.hexdigest(),
        "rows": pq.ParquetFile(p).metadata.num_rows,
    }


def _check_source(source: dict[str, Any]) -> None:
    kind = source.get("kind")
    if kind not in ("sim", "replay"):
        raise RunFormatError(f"source: 'kind' must be 'sim' or 'replay', got {kind!r}")
    if kind == "replay" and not source.get("gpu"):
        raise RunFormatError("source: a replay run must name its 'gpu'")


def _check_trace(trace: dict[str, Any]) -> None:
    missing = [k for k in ("path", "sha256", "rows") if k not in trace]
    if missing:
        raise RunFormatError(f"trace: missing key(s) {missing} (use runfmt.trace_info(path))")


def _jsonable(x: Any) -> Any:
    """NaN/inf -> None, numpy scalars -> Python: summary.json stays strict JSON."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_run(
    out_dir: str | Path,
    rec: RunRecorder | Recording,
    *,
    config: Any,
    trace: dict[str, Any],
    source: dict[str, Any],
    complete: bool = True,
    extra: dict[str, Any] | None = None,
    timeline_max_steps: int | None = DEFAULT_MAX_STEPS,
    timeline_from_s: float = 0.0,
    steps: bool = True,
) -> dict[str, Any]:
    """Write the run folder `out_dir`; returns the summary. `config` is a
    bubblesim.core.config.Config
    or its dict; `trace` is {path, sha256, rows}; `source` {"kind": "sim"} or
    {"kind": "replay", "gpu": name, ...}; `extra` keys are added to summary.json.
    timeline.json holds `timeline_max_steps` steps (None: all) from the first step that starts
    at or after `timeline_from_s` (bubblesim.core.runfmt.timeline.window).
    `steps=False` leaves out the step records (steps.parquet, timeline.json): summary.json
    says so (`step_records`), and `Run.steps` of the folder refuses with one clear line."""
    out = Path(out_dir)
    _check_source(source)
    _check_trace(trace)
    _check_target(out)
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if isinstance(rec, RunRecorder):
        frozen = rec.freeze()  # validates
    else:
        frozen = rec
        validate(frozen)
    pieces_until_s = window(frozen, timeline_max_steps, timeline_from_s).to_s
    bub = account_bubbles(frozen, pieces_until_s=pieces_until_s)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out)  # follows the umask; sweeps dead processes' temps
    try:
        # a steps.parquet of one row group (mostly pyarrow's work, which lets go of the GIL)
        # is written by a thread while this one builds the timeline and the summary; a longer
        # one after them (its row groups are written on codec's own thread: both at once
        # would hold a row group and the summary's arrays together). An error in either
        # removes the temp folder once the thread is done
        one_group = steps and frozen.num_steps <= codec.ROW_GROUP_ROWS
        with ThreadPoolExecutor(1, thread_name_prefix="steps") as pool:
            steps_written = (
                pool.submit(_write_steps, tmp / STEPS, frozen, bub) if one_group else None
            )
            timeline = (
                build_timeline(frozen, bub, source["kind"], timeline_max_steps, timeline_from_s)
                if steps
                else None
            )
            summary = build_summary(
                frozen,
                bub,
                config=cfg,
                trace=trace,
                source=source,
                complete=complete,
                timeline=timeline.other if timeline else None,
                extra=extra,
                step_records=steps,
            )
            # serialized before a file but steps.parquet is written: a bad `extra` value
            # fails here
            summary_text = json.dumps(_jsonable(summary), indent=2, allow_nan=False) + "\n"
            timeline_text = timeline.text if timeline else ""
            del timeline
            codec.write_table(requests_table(frozen), tmp / REQUESTS)
            codec.write_table(gc_table(frozen), tmp / GC_PAUSES)
            if steps_written is not None:
                steps_written.result()
            elif steps:
                _write_steps(tmp / STEPS, frozen, bub)
        if steps:
            (tmp / TIMELINE).write_text(timeline_text)
        (tmp / SUMMARY).write_text(summary_text)  # last: a folder with it is complete
        swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    loaded: dict[str, Any] = json.loads(summary_text)
    return loaded


def _write_steps(path: Path, rec: Recording, bub: Bubbles) -> None:
    """steps.parquet, in row groups of bounded memory (`_step_rows`)."""
    rows, plan_rows = _step_rows(rec, bub)
    codec.write_chunks(path, rec.num_steps, rows, plan_rows=plan_rows)


def _step_rows(
    rec: Recording, bub: Bubbles
) -> tuple[Callable[[int, int], pa.Table], Callable[[int, int], pa.Table]]:
    """steps.parquet's rows [lo, hi) for codec.write_chunks, and the same without its string
    column (all its encoding plan reads); the spilled columns' pages they read are released
    (bubblesim.core.runfmt.spill), so a long run is written in bounded memory."""
    in_order = sync_in_order(rec)

    def rows(lo: int, hi: int, cause: bool = True) -> pa.Table:
        table = steps_table(rec, bub, lo, hi, in_order, cause)
        release(rec.shape, rec.phase_start, rec.phase_end, rec.gpu_start, rec.gpu_end)
        release(rec.accepted, rec.sync_start, rec.sync_end, rec.sync_step)
        return table

    return rows, lambda lo, hi: rows(lo, hi, cause=False)


def _is_run_dir(p: Path) -> bool:
    try:
        summary = json.loads((p / SUMMARY).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("format") == FORMAT


def _check_target(out: Path) -> None:
    if out.is_dir() and any(out.iterdir()) and not _is_run_dir(out):
        raise RunFormatError(f"'{out}' exists and is not a run folder; not replacing it")
    if out.exists() and not out.is_dir():
        raise RunFormatError(f"'{out}' exists and is not a folder")


@dataclass(frozen=True)
class Run:
    """A run folder read back: summary.json as a dict and the parquet files as pyarrow tables
    (in the types of `bubblesim.core.runfmt.tables`, whatever the folder's format version)."""

    path: Path
    summary: dict[str, Any]
    requests: pa.Table
    step_table: pa.Table | None  # None: written without step records (`has_steps`)
    gc: pa.Table
    filled: tuple[str, ...] = ()  # ADDED_STEP_COLUMNS the folder lacked, read as zeros

    @property
    def complete(self) -> bool:
        return bool(self.summary.get("complete"))

    @property
    def has_steps(self) -> bool:
        return self.step_table is not None

    @property
    def steps(self) -> pa.Table:
        """steps.parquet; RunFormatError (one line) for a run written without step records."""
        if self.step_table is None:
            raise RunFormatError(
                f"'{self.path}' has no step records (written with --no-steps); "
                "this needs them: run it again without --no-steps"
            )
        return self.step_table

    def arrays(self, table: str) -> dict[str, np.ndarray]:
        """Columns of `requests`, `steps` or `gc` as numpy arrays (strings as object arrays)."""
        t: pa.Table = getattr(self, table)
        return {name: t.column(name).to_numpy() for name in t.column_names}


def load_run(path: str | Path) -> Run:
    """Read a run folder; RunFormatError with one clear line if it is not a valid run."""
    p = Path(path)
    if not p.is_dir():
        raise RunFormatError(f"'{p}' is not a run folder: no such directory")
    try:
        summary = json.loads((p / SUMMARY).read_text())
    except FileNotFoundError:
        raise RunFormatError(f"'{p}' is not a run folder: no {SUMMARY}") from None
    except ValueError as e:
        raise RunFormatError(f"'{p}/{SUMMARY}' is not valid JSON: {e}") from None
    if not isinstance(summary, dict) or summary.get("format") != FORMAT:
        raise RunFormatError(f"'{p}/{SUMMARY}' is not a run summary (no format={FORMAT!r})")
    if summary.get("format_version") not in READ_VERSIONS:
        raise RunFormatError(
            f"'{p}': run format version {summary.get('format_version')!r}, "
            f"this code reads {' and '.join(map(str, READ_VERSIONS))}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in summary]
    if missing:
        raise RunFormatError(f"'{p}/{SUMMARY}': missing key(s) {missing}")
    requests = _read_table(p / REQUESTS, REQUEST_COLUMNS)[0]
    steps: pa.Table | None = None
    filled: tuple[str, ...] = ()
    if summary.get("step_records", True):
        steps, filled = _read_table(p / STEPS, STEP_COLUMNS, ADDED_STEP_COLUMNS)
    gc = _read_table(p / GC_PAUSES, GC_COLUMNS)[0]
    return Run(p, summary, requests, steps, gc, filled)


def _read_table(
    path: Path, columns: tuple[str, ...], added: tuple[str, ...] = ()
) -> tuple[pa.Table, tuple[str, ...]]:
    """The table, and which of `added` it lacked: those are int64 zeros, placed after the
    columns that precede them in `columns`."""
    if not path.is_file():
        raise RunFormatError(f"'{path.parent}' is not a complete run folder: no {path.name}")
    try:
        table = codec.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise RunFormatError(f"'{path}' is not readable parquet: {e}") from None
    except codec.CodecError as e:
        raise RunFormatError(f"'{path}': {e}") from None
    missing = [c for c in columns if c not in table.column_names]
    absent = [c for c in missing if c not in added]
    if absent:
        raise RunFormatError(f"'{path}': missing column(s) {absent}")
    for c in missing:  # in `columns` order
        before = [x for x in columns[: columns.index(c)] if x in table.column_names]
        at = table.column_names.index(before[-1]) + 1 if before else 0
        table = table.add_column(at, c, pa.array(np.zeros(table.num_rows, np.int64)))
    return table, tuple(missing)
