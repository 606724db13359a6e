"""On CUDA: the warm-up leaves no Triton compile to the measured run, the shape model's split
counts are the kernels' own, and the measured hooks read their events after the run. Skipped
without CUDA; imports no simpy/polars (runs on the GPU host).

    python -m pytest -q -s tests/test_warmup_gpu.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bubblesim.core.config import Config
from bubblesim.core.models import get_model
from bubblesim.core.trace import read_trace, write_trace

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def test_gpu_split_models_match_the_kernels():
    from engine.kernels.decode_attention import decode_num_splits
    from engine.kernels.paged_attention import choose_num_splits
    from engine.warmup import decode_splits, paged_splits

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for programs in (1, 3, 8, 16, 40, 100, 263, 264, 1000):
        for mq in (1, 2, 7, 16, 17, 300):
            for ms in (1, 255, 256, 257, 700, 2049, 4097, 100_000):
                want = choose_num_splits(programs, mq, ms, dev)
                assert paged_splits(programs, mq, ms, sms) == want, (programs, mq, ms)
    for seqs in (1, 2, 3, 5, 16, 33, 64, 256):
        for kv in (1, 2, 8):
            for ms in (1, 31, 32, 33, 65, 700, 1025, 5000, 131072):
                want = decode_num_splits(seqs, kv, ms, dev)
                assert decode_splits(seqs, kv, ms, sms) == tuple(want), (seqs, kv, ms)


def _window(src: Path, seconds: float, out: Path, model: str) -> Path:
    t = read_trace(src, get_model(model))
    return write_trace(t.take(np.flatnonzero(t.arrival_s < seconds)), out)


CASES = {
    # compressed Azure conversations: prompts of 2..4k tokens, dense arrivals, mixed batches
    "azure45x4": ("traces/fidelity/azure45x4.parquet", 8.0, {}),
    # Mooncake: prefix groups (cache hits: short chunks on long contexts), prompts > 8k chunked
    "mooncake45": ("traces/fidelity/mooncake45.parquet", 12.0, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_replay_measures_no_triton_compile(case: str, tmp_path: Path):
    from replay.gpu.run import replay

    src, seconds, sets = CASES[case]
    trace = _window(ROOT / src, seconds, tmp_path / "t.parquet", "llama3.2-1b")
    cfg = Config(model="llama3.2-1b", device="cuda", num_kv_blocks=40000, **sets)
    res = replay(cfg, trace, tmp_path / "run")
    rep = res.summary["replay"]
    warm = rep["warmup"]
    print(case, json.dumps({"warmup": warm, "measured": rep["jit_compiles"]}, indent=1))
    print(case, "instrumentation", rep["instrumentation"])
    assert res.summary["complete"]
    assert warm["jit_compiles"]["applicable"] and warm["forward_steps"] > 0
    assert rep["jit_compiles"]["applicable"] is True
    assert rep["jit_compiles"]["count"] == 0, rep["jit_compiles"]["by_kernel"]
    assert rep["instrumentation"]["event_ring"] >= res.summary["num_steps"]
    assert warm["forward_compiles"] == "parallel"  # else the warm-up only took longer


def test_gpu_replay_spec_decoding_measures_no_triton_compile(tmp_path: Path):
    """Speculative decoding adds its own per-step kernels (input correction); met by the
    warm-up's requests rather than by the shape model."""
    from replay.gpu.run import replay

    trace = ROOT / "traces/seed5_optimistic.parquet"
    cfg = Config(model="llama3.2-1b", device="cuda", num_kv_blocks=20000, arrival="asap")
    cfg = cfg.replace(**{"spec.method": "ngram-gpu", "spec.k": 3})
    res = replay(cfg, trace, tmp_path / "run", max_seconds=120)
    rep = res.summary["replay"]
    print("spec", json.dumps({"warmup": rep["warmup"], "measured": rep["jit_compiles"]}, indent=1))
    assert rep["jit_compiles"]["count"] == 0, rep["jit_compiles"]["by_kernel"]


def test_gpu_measured_hooks_read_events_after_the_run():
    """A ring longer than the run: no step reads an event, finish() reads them all, and the GPU
    intervals are ordered and inside the run."""
    from bubblesim.core.shape import BatchShape
    from engine.hooks import StepHooks
    from replay.gpu.measure import step_hook_calls

    h = StepHooks(torch.device("cuda"), ring=600)
    t0 = h.start()
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(500):
        step_hook_calls(h, BatchShape(num_reqs=1, decode_tokens=1))
        x = x @ x.T / 2048  # some GPU work between the marks of the next step
    tr = h.finish()
    g = tr.gpu_ns
    assert (g >= t0).all() and (g[:, 1] >= g[:, 0]).all()
    assert (np.diff(g[:, 0]) >= 0).all()
