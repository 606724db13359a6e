"""The worker ranks' own launches beside a tensor-parallel run's steps: `DIR/ranks.parquet`.

Rank 0's hooks time rank 0's phases only. An eager step's all-reduces wait for the last rank
to issue them, so its GPU pass ends after the slowest rank's launch (`launch.eager_lag_ms`,
replay.analysis.eagerlag). The worker ranks record their own launch of every step
(engine.tp.ranktimes) and replay writes it here, one row per (worker rank, step):

- `rank` (1 .. size - 1), `step` (the run's step row, as in steps.parquet);
- `recv_s`: when the step's header reached the rank; `launch_start_s`, `launch_end_s`: the
  rank's input finishing and forward issue (or graph replay), rank 0's `launch` phase.

Times are seconds since the run's zero, the clock of steps.parquet (perf_counter: one monotonic
clock for all processes of the host). A run at tensor_parallel_size 1, or one measured before
the record existed, has no file (`read_ranks` gives None).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bubblesim.core.atomic import replacing

RANKS_FILE = "ranks.parquet"
_COLUMNS = ("rank", "step", "recv_s", "launch_start_s", "launch_end_s")


@dataclass
class RankLaunches:
    """The rows of a ranks.parquet (module docstring), as arrays."""

    rank: np.ndarray  # int64
    step: np.ndarray  # int64
    recv_s: np.ndarray
    launch_start_s: np.ndarray
    launch_end_s: np.ndarray

    def last_end_s(self, num_steps: int) -> np.ndarray:
        """Per step, the latest worker rank's launch end (NaN where no worker recorded it)."""
        out = np.full(num_steps, -np.inf)
        ok = (self.step >= 0) & (self.step < num_steps)
        np.maximum.at(out, self.step[ok], self.launch_end_s[ok])
        out[np.isneginf(out)] = np.nan
        return out


def write_ranks(out_dir: str | Path, rank_ns: np.ndarray, t0_ns: int) -> Path | None:
    """Write `rank_ns` (engine.tp.ranktimes.COLUMNS, perf_counter ns; the run's zero `t0_ns`)
    as out_dir/ranks.parquet, whole or not at all; nothing (None) for an empty record."""
    if rank_ns.size == 0:
        return None
    rank_ns = np.asarray(rank_ns, np.int64).reshape(-1, len(_COLUMNS))
    secs = (rank_ns[:, 2:] - t0_ns) / 1e9
    table = pa.table(
        {
            "rank": pa.array(rank_ns[:, 0]),
            "step": pa.array(rank_ns[:, 1]),
            **{name: pa.array(secs[:, j]) for j, name in enumerate(_COLUMNS[2:])},
        }
    )
    target = Path(out_dir) / RANKS_FILE
    with replacing(target) as tmp:
        pq.write_table(table, tmp)
    return target


def read_ranks(run_dir: str | Path) -> RankLaunches | None:
    """The run folder's worker-rank launches, or None when it has none. Raises ValueError
    naming the file when it lacks a column."""
    path = Path(run_dir) / RANKS_FILE
    if not path.is_file():
        return None
    table = pq.read_table(path)
    missing = [c for c in _COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
    cols = {c: table.column(c).to_numpy() for c in _COLUMNS}
    return RankLaunches(
        cols["rank"].astype(np.int64),
        cols["step"].astype(np.int64),
        cols["recv_s"].astype(np.float64),
        cols["launch_start_s"].astype(np.float64),
        cols["launch_end_s"].astype(np.float64),
    )
