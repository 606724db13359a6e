"""`replay run --profile-kernels`: one extra run of the trace under torch.profiler, apart from
the measured runs (the profiler adds overhead, so its times never enter a run folder).

Writes DIR/kernels.txt (torch.profiler's table, by device time), DIR/kernels.json (the top
kernels as data) and DIR/trace.json (Chrome trace, openable in Perfetto), atomically.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bubblesim.core.config import Config
from replay.analysis.outdir import atomic_dir
from replay.gpu.run import check_trace, new_engine, warm_up

TOP_KERNELS = 40


def profile_kernels(cfg: Config, trace_path: str | Path, out: Path) -> Path:
    trace = check_trace(cfg, trace_path)
    engine, _ = new_engine(cfg, None)
    warm_up(engine)
    acts = [ProfilerActivity.CPU]
    if cfg.device == "cuda":
        acts.append(ProfilerActivity.CUDA)
    try:
        with profile(activities=acts, record_shapes=False) as prof:
            engine.run(trace)
    finally:
        gc.unfreeze()  # see replay.gpu.run.replay
    if cfg.device == "cuda":
        torch.cuda.synchronize()
    averages = prof.key_averages()
    key = "self_cpu_time_total"
    if cfg.device == "cuda":  # torch >= 2.4 names device time generically; older: cuda
        sample = averages[0] if len(averages) else None
        key = next(
            (k for k in ("self_device_time_total", "self_cuda_time_total") if hasattr(sample, k)),
            "self_cpu_time_total",
        )
    with atomic_dir(out, "kernels.txt") as tmp:
        (tmp / "kernels.txt").write_text(averages.table(sort_by=key, row_limit=TOP_KERNELS))
        (tmp / "kernels.json").write_text(json.dumps(_top(averages, key), indent=2) + "\n")
        prof.export_chrome_trace(str(tmp / "trace.json"))
    return out


def _top(averages: Any, key: str) -> list[dict[str, Any]]:
    rows = sorted(averages, key=lambda e: getattr(e, key, 0), reverse=True)[:TOP_KERNELS]
    return [
        {
            "name": e.key,
            "count": e.count,
            "self_us": getattr(e, key, 0),
            "mean_us": getattr(e, key, 0) / e.count if e.count else None,
        }
        for e in rows
    ]
