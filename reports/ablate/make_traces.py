"""Derive the short seed workloads of the ablation report (traces/fidelity/seed5_2s.parquet).

- seed5_2s: traces/seed5_optimistic.parquet (8 requests, token ids, 512 outputs) with one
  request every 2 s instead of 4: still about one request in flight (a request takes < 1 s on
  llama3.2-1b and ~1.5 s on llama3-8b on an H100/H200), and a replay takes 15 s, not 29.

    python reports/ablate/make_traces.py
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from bubblesim.core.trace import read_trace, write_trace

ROOT = Path(__file__).resolve().parents[2]
GAP_S = 2.0


def main() -> None:
    t = read_trace(ROOT / "traces" / "seed5_optimistic.parquet")
    t = replace(t, arrival_s=np.arange(len(t), dtype=np.float64) * GAP_S, metadata={
        **t.metadata, "description": f"{t.metadata.get('description', '')}; re-spaced to one "
        f"request every {GAP_S:g} s (reports/ablate/make_traces.py)",
    })  # fmt: skip
    out = write_trace(t, ROOT / "traces" / "fidelity" / "seed5_2s.parquet")
    print(f"{out.relative_to(ROOT)}: {len(t)} requests, last at {t.arrival_s.max():g} s")


if __name__ == "__main__":
    main()
