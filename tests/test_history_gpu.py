"""On CUDA (skipped without): a synthetic batch with history rows replays the decode graph's
penalties variant, all or nothing per step, and a small decode sweep's history pairs fit a
positive cost. Imports nothing of sim/ (the GPU host has no simpy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bubblesim.core.config import Config
from replay.analysis.historyfit import fit_history
from replay.analysis.shapes_file import read_sweeps
from replay.analysis.shapes_grid import Batch, Entry
from replay.gpu.shapes_step import stage


@pytest.mark.gpu
def test_gpu_history_rows_replay_the_penalties_graph(tmp_path: Path):
    """On CUDA a decode(history) batch replays its bucket's penalties variant (a plain decode
    batch the plain one), and a small sweep of both times the history rows slower."""
    from engine.engine import Engine
    from replay.gpu.shapes import sweep
    from replay.gpu.shapes_step import MarkHooks

    cfg = Config(
        model="tiny", device="cuda", max_num_batched_tokens=512, max_num_seqs=32,
        max_model_len=4096, gc_freeze=False,
    )  # fmt: skip
    eng = Engine(cfg)
    eng.hooks = MarkHooks(eng.device)
    assert eng.graphs is not None
    seen: list[tuple[int, bool]] = []
    replay = eng.graphs.replay

    def spy(bucket: int, with_history: bool = False):  # type: ignore[no-untyped-def]
        seen.append((bucket, with_history))
        return replay(bucket, with_history)

    eng.graphs.replay = spy  # type: ignore[method-assign]
    for with_hist in (lambda i: True, lambda i: i == 0, lambda i: False):
        rows = tuple(Entry(300, 1, False, hist=with_hist(i)) for i in range(7))
        with torch.no_grad():
            st = stage(eng, Batch("decode(history)", rows))
            st.before()
            st.launch()
            torch.cuda.synchronize()
            st.after()
    assert seen == [(8, True), (8, True), (8, False)]  # one history row is enough: all or nothing
    res = sweep(cfg, tmp_path / "g.parquet", repeats=3, kinds=("decode",))
    rows_ = read_sweeps([res.path])
    model, report = fit_history(rows_)
    assert model is not None and report["pairs"] > 5
    assert report["ratio_p50"] > 1.0
