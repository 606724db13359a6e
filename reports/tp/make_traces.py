"""Workloads for llama3-70b at TP4 on H100s (traces/tp/*.parquet), sized for that replica.

A llama3-70b TP4 step decodes ~1.5-3k tokens/s and prefills ~25k tokens/s on 4 x H100, a
quarter to a third of what the one-GPU sets (traces/checks*, made for llama3.2-1b and llama3-8b)
ask, so those sets would queue for minutes. These are other windows of the same public data and
other seeds, at rates the replica serves in about a minute. `calib70` is the calibration run;
the rest are checks the TP4 profile never reads:

| name | what | from |
|---|---|---|
| calib70 | the Azure hour's first 60 s at 1.25x (48 s), depth 2 | Azure 2023 |
| azure70_mid | minutes 30:00-30:27 at 0.6x (45 s), depth 2 | Azure 2023 |
| azure70_d1 | minutes 45:00-45:40 at 1x, run at depth 1 | Azure 2023 |
| longout70 | ~1.5k-token outputs, ~600-token prompts, 1.2 req/s for 30 s: batches ~30 | synth |
| reasoning70 | reasoning-length outputs (to 4k), 09:00 at 0.1x for 25 s, penalties | ServeGen R1 |
| asap70 | 48 ShareGPT-length requests queued at once (arrival=asap): saturated | ShareGPT |

    python reports/tp/make_traces.py    # writes traces/tp/, prints each trace's size
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "reports" / "fidelity"))
sys.path.insert(0, str(ROOT / "traces"))
sys.path.insert(0, str(ROOT))

from build import shared_traces  # noqa: E402  (traces/build.py: where the public data is)
from make_checks import synth, window  # noqa: E402

from bubblesim.core.trace import Trace, read_trace, write_trace  # noqa: E402
from bubblesim.workloads.servegen import servegen_trace  # noqa: E402

OUT = ROOT / "traces" / "tp"
AZURE = "traces/azure_conv.parquet"


def build() -> dict[str, Trace]:
    az = read_trace(ROOT / AZURE)
    out: dict[str, Trace] = {
        "calib70": window(az, 0.0, 48.0, 1.25, AZURE),
        "azure70_mid": window(az, 1800.0, 45.0, 0.6, AZURE),
        "azure70_d1": window(az, 2700.0, 40.0, 1.0, AZURE),
    }
    out["longout70"] = synth(
        "long outputs for a TP4 replica", arrival="poisson", rate=1.2, duration_s=30.0,
        prompt_len="lognormal:600:0.6:3000", output_len="lognormal:1500:0.3:3000", seed=31,
    )  # fmt: skip
    out["reasoning70"] = servegen_trace(
        shared_traces() / "servegen_deepseek_r1", seed=33, start_s=9 * 3600.0,
        duration_s=25.0, rate_scale=0.1, max_output=4096,
    )  # fmt: skip
    out["asap70"] = synth(
        "saturated throughput for a TP4 replica (run with arrival=asap)", arrival="fixed",
        rate=1000.0, num_requests=48, lengths_from=str(shared_traces() /
        "sarathi_sharegpt_lengths" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"), seed=35,
    )  # fmt: skip
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, t in build().items():
        write_trace(t, OUT / f"{name}.parquet")
        dur = float(t.arrival_s.max() - t.arrival_s.min()) if len(t) else 0.0
        print(f"{name:12s} {len(t):5d} requests over {dur:5.1f} s, prompt mean "
              f"{t.prompt_len.mean():6.0f}, output mean {t.output_len.mean():5.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
