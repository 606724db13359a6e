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

from bubblesim.core.trace import Trace, make_trace, read_trace, write_trace
from bubblesim.core.tracecut import cut_trace

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "traces" / "fidelity"


def window(
    t: Trace,
    seconds: float,
    speedup: float = 1.0,
    max_prompt_len: int | None = None,
    source: str | None = None,
) -> Trace:
    """The first `seconds` x `speedup` s of `t`, compressed into `seconds` (the same operation
    as `python -m sim trace cut --from-s 0 --to-s SECONDS*SPEEDUP --speedup SPEEDUP`)."""
    return cut_trace(t, 0.0, seconds * speedup, speedup, max_prompt_len, source).trace


def main(out: Path = OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    az = read_trace(ROOT / "traces" / "azure_conv.parquet")
    write_trace(window(az, 45, source="traces/azure_conv.parquet"), out / "azure45.parquet")
    az4 = window(az, 45, 4.0, source="traces/azure_conv.parquet")
    write_trace(az4, out / "azure45x4.parquet")
    rs = read_trace(ROOT / "traces" / "reasoning.parquet")
    rs = window(rs, 45, 4.0, source="traces/reasoning.parquet")
    rs = replace(rs, output_len=np.minimum(rs.output_len, 2048).astype(np.int32),
                 needs_history=np.ones(len(rs), dtype=bool))  # fmt: skip
    write_trace(rs, out / "reasoning45.parquet")
    mc = read_trace(ROOT / "traces" / "mooncake.parquet")
    mc = window(mc, 45, max_prompt_len=16384, source="traces/mooncake.parquet")
    write_trace(mc, out / "mooncake45.parquet")
    n = 128
    s3 = make_trace(np.zeros(n), np.full(n, 4096), np.full(n, 6000),
                    needs_history=np.ones(n, dtype=bool))  # fmt: skip
    s3.metadata["description"] = "seed 3 scenario at 1/10 output length (128 x 4096 in / 6000 out)"
    write_trace(s3, out / "seed3_scaled.parquet")
    for p in sorted(out.glob("*.parquet")):
        t = read_trace(p)
        print(
            f"{p.name:24} {len(t):6d} req  span {t.arrival_s.max():6.1f} s  "
            f"prompt {t.prompt_len.mean():7.0f}  output {t.output_len.mean():6.0f}"
        )


if __name__ == "__main__":
    main()
