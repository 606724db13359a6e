"""The out-of-sample check workloads of the fidelity protocol (traces/checks/*.parquet).

A committed profile is made once per (model, GPU) from a clean-GPU sweep and one short
calibration run (traces/fidelity/azure45x4.parquet); these workloads are never used to fit it.
They span the operating envelope the issue names, each a window a replay fits in about a
minute (arrivals in real time, except `asap`):

| name | what | from |
|---|---|---|
| longout | long outputs (~1.5k tokens, ~1k prompts) at 8 req/s: batches of 20-70 | synthetic |
| longprompt | long prompts (8-32k) with shared prefixes | Mooncake, 300-345 s window |
| burst | bursty short completions: 2k prompts, ~25 output tokens, gamma CV 4 | synthetic |
| reasoning | reasoning-length outputs (to 4k), penalties; 13:00 of the day at 2x | ServeGen R1 |
| specdec | n-gram speculative decoding on real text (run with spec.method=ngram-gpu) | synthetic |
| azure_late | the Azure hour's minutes 20:00-23:00 at 4x (run at depths 1 and 3) | Azure 2023 |
| asap | 384 ShareGPT-length requests queued at once (arrival=asap): saturated | ShareGPT |

    python reports/fidelity/make_checks.py      # writes traces/checks/, prints a table
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "traces"))

from build import shared_traces  # noqa: E402  (traces/build.py: where the public data is)

from bubblesim.core.trace import Trace, read_trace, write_trace  # noqa: E402
from bubblesim.core.tracecut import cut_trace  # noqa: E402
from bubblesim.workloads.lengths import parse_length  # noqa: E402
from bubblesim.workloads.servegen import servegen_trace  # noqa: E402
from bubblesim.workloads.synth import SynthSpec, synthesize  # noqa: E402

OUT = ROOT / "traces" / "checks"


def window(t: Trace, start_s: float, seconds: float, speedup: float, source: str) -> Trace:
    """Requests arriving in [start_s, start_s + seconds * speedup), shifted to 0, compressed
    (`python -m sim trace cut`)."""
    return cut_trace(t, start_s, start_s + seconds * speedup, speedup, source=source).trace


def synth(desc: str, **kw: object) -> Trace:
    for k in ("prompt_len", "output_len"):
        if isinstance(kw.get(k), str):
            kw[k] = parse_length(str(kw[k]))
    t = synthesize(SynthSpec(**kw))  # type: ignore[arg-type]
    t.metadata["description"] = f"{desc}; {t.metadata['description']}"
    return t


def build() -> dict[str, Trace]:
    out: dict[str, Trace] = {}
    out["longout"] = synth(
        "long outputs", arrival="poisson", rate=8.0, duration_s=45.0,
        prompt_len="lognormal:1000:0.5:4000", output_len="lognormal:1500:0.25:2000", seed=11,
    )  # fmt: skip
    mc = read_trace(ROOT / "traces" / "mooncake.parquet")
    lp = window(mc, 300.0, 45.0, 1.0, "traces/mooncake.parquet")
    keep = np.flatnonzero((lp.prompt_len >= 2048) & (lp.prompt_len <= 32768))
    out["longprompt"] = lp.take(keep)
    out["burst"] = synth(
        "bursty short completions", arrival="gamma", rate=6.0, cv=4.0, duration_s=45.0,
        prompt_len="lognormal:2000:0.4:6000", output_len="lognormal:25:0.5:120", seed=12,
    )  # fmt: skip
    rs = servegen_trace(shared_traces() / "servegen_deepseek_r1", seed=13, start_s=13 * 3600.0,
                        duration_s=45.0, rate_scale=2.0, max_output=4096)  # fmt: skip
    out["reasoning"] = rs
    out["specdec"] = synth(
        "n-gram speculative decoding on real text", arrival="poisson", rate=4.0, duration_s=30.0,
        prompt_len="uniform:256:1536", output_len="uniform:128:640", token_ids=True,
        ngram_friendly=True, seed=14,
    )  # fmt: skip
    az = read_trace(ROOT / "traces" / "azure_conv.parquet")
    out["azure_late"] = window(az, 1200.0, 45.0, 4.0, "traces/azure_conv.parquet")
    sg = synth(
        "saturated throughput (run with arrival=asap)", arrival="fixed", rate=1000.0,
        num_requests=384, lengths_from=str(shared_traces() / "sarathi_sharegpt_lengths" /
        "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"), seed=15,
    )  # fmt: skip
    out["asap"] = sg
    return out


def main(out: Path = OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, t in build().items():
        write_trace(t, out / f"{name}.parquet")
        print(
            f"{name:12} {len(t):5d} req  span {t.arrival_s.max():6.1f} s  "
            f"prompt mean {t.prompt_len.mean():7.0f} max {t.prompt_len.max():6d}  "
            f"output mean {t.output_len.mean():6.0f} max {t.output_len.max():6d}"
        )


if __name__ == "__main__":
    main()
