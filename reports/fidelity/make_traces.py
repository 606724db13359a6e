"""Derive the short fidelity workloads (traces/fidelity/*.parquet) from the bundled traces.

Replay runs in real time, so each workload is a window of tens of seconds:
- azure45: the first 45 s of the Azure conversation hour, as recorded (~5.5 req/s);
- azure45x4: the first 180 s compressed 4x into 45 s (~22 req/s: deeper batches);
- reasoning45: 45 s of the ServeGen reasoning day at 4x its rate, outputs capped at 2,048
  tokens, every request needs its output history (penalties);
- mooncake45: the first 45 s of the Mooncake trace with prompts capped at 16k tokens
  (prefill-heavy, shared prefixes);
- seed3_scaled: 128 requests at t=0, 4,096-token prompts, 6,000-token outputs, needs_history
  (the placeholder-scan scenario of seed 3 at a tenth of its output length, so a replay fits
  a few minutes; the scan cost per step at the end is 128 x 10k elements).

    python reports/fidelity/make_traces.py
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from core.trace import Trace, make_trace, read_trace, write_trace

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "traces" / "fidelity"


def window(t: Trace, seconds: float, speedup: float = 1.0) -> Trace:
    rows = np.flatnonzero(t.arrival_s < seconds * speedup)
    w = t.take(rows)
    return replace(w, arrival_s=w.arrival_s / speedup, metadata={
        **t.metadata, "description": f"first {seconds * speedup:g} s of "
        f"{t.metadata.get('description', 'a bundled trace')} at {speedup:g}x",
    })  # fmt: skip


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    az = read_trace(ROOT / "traces" / "azure_conv.parquet")
    write_trace(window(az, 45), OUT / "azure45.parquet")
    write_trace(window(az, 45, 4.0), OUT / "azure45x4.parquet")
    rs = window(read_trace(ROOT / "traces" / "reasoning.parquet"), 45, 4.0)
    rs = replace(rs, output_len=np.minimum(rs.output_len, 2048).astype(np.int32),
                 needs_history=np.ones(len(rs), dtype=bool))  # fmt: skip
    write_trace(rs, OUT / "reasoning45.parquet")
    mc = window(read_trace(ROOT / "traces" / "mooncake.parquet"), 45)
    keep = np.flatnonzero(mc.prompt_len <= 16384)
    write_trace(mc.take(keep), OUT / "mooncake45.parquet")
    n = 128
    s3 = make_trace(np.zeros(n), np.full(n, 4096), np.full(n, 6000),
                    needs_history=np.ones(n, dtype=bool))  # fmt: skip
    s3.metadata["description"] = "seed 3 scenario at 1/10 output length (128 x 4096 in / 6000 out)"
    write_trace(s3, OUT / "seed3_scaled.parquet")
    for p in sorted(OUT.glob("*.parquet")):
        t = read_trace(p)
        print(
            f"{p.name:24} {len(t):6d} req  span {t.arrival_s.max():6.1f} s  "
            f"prompt {t.prompt_len.mean():7.0f}  output {t.output_len.mean():6.0f}"
        )


if __name__ == "__main__":
    main()
