"""Golden runs: a small fixed trace through a few configs must give the pinned headline numbers
(tests/golden/sim_golden.json): throughput, bubble fraction, TTFT and TPOT p50, steps, GC
collections, preemptions.

A change to the simulator, the policy or the cost model that moves them fails here on purpose.
If the move is intended, regenerate the file and review the diff in the commit:

    SIM_GOLDEN_UPDATE=1 python -m pytest tests/test_sim_golden.py

The trace is built from arithmetic (no random generator), so it is the same everywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import load_config
from bubblesim.core.trace import make_trace, write_trace
from sim.run import simulate

GOLDEN = Path(__file__).parent / "golden" / "sim_golden.json"
CONFIGS: dict[str, list[str]] = {
    "llama3-8b depth 2": ["model=llama3-8b"],
    "llama3-8b depth 1 no graphs": ["model=llama3-8b", "batches_in_flight=1", "cuda_graphs=false"],
    "llama3.2-1b depth 3 unfrozen gc": [
        "model=llama3.2-1b",
        "batches_in_flight=3",
        "gc_freeze=false",
    ],
    "llama3-8b small kv": ["model=llama3-8b", "num_kv_blocks=120", "max_num_seqs=16"],
    "tiny cpu-bound chunked": ["model=tiny", "max_num_batched_tokens=256", "gc_freeze=false"],
}
REL = 1e-7  # floats: room for libm differences in the last bits, nothing more


def golden_trace(path: Path) -> Path:
    n = 60
    i = np.arange(n)
    arrival = i * 0.04 + (i * 7 % 11) * 0.003
    prompt = 40 + (i * 37) % 700
    output = 5 + (i * 53) % 180
    return write_trace(make_trace(arrival, prompt, output, needs_history=i % 3 == 0), path)


def headline(summary: dict) -> dict:
    return {
        "output_tok_per_s": summary["output_tok_per_s"],
        "bubble_fraction": summary["bubble_fraction"],
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "tpot_p50_s": summary["tpot_s"]["p50"],
        "num_steps": summary["num_steps"],
        "gc_collections": summary["sim"]["gc_collections"],
        "preemptions": summary["sim"]["preemptions"],
    }


def compute(tmp: Path) -> dict[str, dict]:
    trace = golden_trace(tmp / "golden.parquet")
    return {
        name: headline(simulate(load_config(None, sets), trace, tmp / f"run{k}").summary)
        for k, (name, sets) in enumerate(CONFIGS.items())
    }


def test_golden_runs(tmp_path: Path) -> None:
    got = compute(tmp_path)
    if os.environ.get("SIM_GOLDEN_UPDATE"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
        pytest.skip(f"golden values written to {GOLDEN}")
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want), "configs changed: regenerate the golden file"
    for name, values in want.items():
        for key, v in values.items():
            g = got[name][key]
            if isinstance(v, float):
                assert g == pytest.approx(v, rel=REL, abs=1e-12), f"{name}: {key} {g} != {v}"
            else:
                assert g == v, f"{name}: {key} {g} != {v}"
