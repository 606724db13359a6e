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

A second set (`traces/checks2/`, `python reports/fidelity/make_checks.py 2`) was made after
every model term of the committed profiles was in place and measured once, as the clean test
those terms had not been read against: other windows of the same public data, other seeds,
heavier load (batches to ~100 on long outputs, a prefill-heavy saturated run).

| name | what | from |
|---|---|---|
| azure_mid | the Azure hour's minutes 40:00-43:00 at 4x (~22 req/s), depth 2 | Azure 2023 |
| azure_d1 | minutes 50:00-52:15 at 3x, run at depth 1 | Azure 2023 |
| longout_hi | ~2k-token outputs, ~600-token prompts, 5 req/s for 30 s: batches ~100 | synthetic |
| longprompt2 | long prompts (2-32k) with shared prefixes, 700-730 s window | Mooncake |
| burst2 | bursty completions, gamma CV 6 at 10 req/s, 600/80 tokens | synthetic |
| reasoning2 | reasoning-length outputs (to 4k), 03:00 at 0.25x, penalties | ServeGen R1 |
| specdec2 | n-gram speculative decoding, longer outputs (spec.method=ngram-gpu) | synthetic |
| asap2 | 256 prefill-heavy requests (~3k prompts, ~200 outputs) queued at once | synthetic |

A third set (`traces/checks3/`, 2026-11-27) checks the penalties' GPU cost after it was split
into a decode graph term and a verify term (replay.analysis.historyfit): workloads with
penalties on every request that no profile term was read against.

| name | what | from |
|---|---|---|
| specpen | n-gram speculative decoding with penalties on every request (ngram-gpu) | synthetic |
| reasoning3 | reasoning-length outputs (to 4k), 08:00 at 0.3x, penalties | ServeGen R1 |

A fourth set (`traces/checks4/`, 2026-11-27) checks the loop's request intake (profile key
`intake`, replay.analysis.intake): arrival rates well above every earlier check's, where the
host takes requests in at a large share of the loop tops.

| name | what | from |
|---|---|---|
| highrate | short chat (~300-token prompts, ~60 outputs), Poisson 100 req/s | synthetic |
| azure_x10 | the Azure hour's minutes 10:00-13:20 at 10x (~50 req/s) | Azure 2023 |

    python reports/fidelity/make_checks.py      # writes traces/checks/, prints a table
    python reports/fidelity/make_checks.py 2    # writes traces/checks2/
    python reports/fidelity/make_checks.py 3    # writes traces/checks3/
    python reports/fidelity/make_checks.py 4    # writes traces/checks4/
    python reports/fidelity/make_checks.py calib  # writes traces/fidelity/specdec_pen.parquet
    python reports/fidelity/make_checks.py ramp   # writes traces/fidelity/ramp.parquet
    python reports/fidelity/make_checks.py ramp_long  # writes traces/fidelity/ramp_long.parquet

The calibration workload for the penalties' host work on spec steps (`history_host`,
2026-11-27): the bundled spec calibration trace (traces/specdec.parquet) with every other
request needing its output history, so the run holds verify steps with and without history
rows (`bash reports/fidelity/gpu_checks.sh calib-specpen MODEL OUT PACK`).
"""

from __future__ import annotations

import dataclasses
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
OUT2 = ROOT / "traces" / "checks2"
OUT3 = ROOT / "traces" / "checks3"
OUT4 = ROOT / "traces" / "checks4"


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


def build2() -> dict[str, Trace]:
    """The second, fresh set: other windows, other seeds, heavier load (module docstring)."""
    out: dict[str, Trace] = {}
    az = read_trace(ROOT / "traces" / "azure_conv.parquet")
    out["azure_mid"] = window(az, 2400.0, 45.0, 4.0, "traces/azure_conv.parquet")
    out["azure_d1"] = window(az, 3000.0, 45.0, 3.0, "traces/azure_conv.parquet")
    out["longout_hi"] = synth(
        "long outputs, batches to ~100", arrival="poisson", rate=5.0, duration_s=30.0,
        prompt_len="lognormal:500:0.6:3000", output_len="lognormal:2000:0.3:4000", seed=21,
    )  # fmt: skip
    mc = read_trace(ROOT / "traces" / "mooncake.parquet")
    lp = window(mc, 700.0, 30.0, 1.0, "traces/mooncake.parquet")
    keep = np.flatnonzero((lp.prompt_len >= 2048) & (lp.prompt_len <= 32768))
    out["longprompt2"] = lp.take(keep)
    out["burst2"] = synth(
        "bursty completions", arrival="gamma", rate=10.0, cv=6.0, duration_s=45.0,
        prompt_len="lognormal:600:0.6:4000", output_len="lognormal:80:0.6:400", seed=22,
    )  # fmt: skip
    out["reasoning2"] = servegen_trace(
        shared_traces() / "servegen_deepseek_r1", seed=23, start_s=3 * 3600.0,
        duration_s=30.0, rate_scale=0.25, max_output=4096,
    )  # fmt: skip
    out["specdec2"] = synth(
        "n-gram speculative decoding, longer outputs", arrival="poisson", rate=6.0,
        duration_s=30.0, prompt_len="uniform:128:1024", output_len="uniform:256:1024",
        token_ids=True, ngram_friendly=True, seed=24,
    )  # fmt: skip
    out["asap2"] = synth(
        "prefill-heavy saturated throughput (run with arrival=asap)", arrival="fixed",
        rate=1000.0, num_requests=256, prompt_len="lognormal:3000:0.5:12000",
        output_len="lognormal:200:0.5:800", seed=25,
    )  # fmt: skip
    return out


def build3() -> dict[str, Trace]:
    """The third set: penalties on every request, with and without spec decoding."""
    out: dict[str, Trace] = {}
    out["specpen"] = synth(
        "n-gram speculative decoding, penalties on every request", arrival="poisson", rate=6.0,
        duration_s=30.0, prompt_len="uniform:128:1024", output_len="uniform:256:1024",
        token_ids=True, ngram_friendly=True, needs_history=1.0, seed=31,
    )  # fmt: skip
    out["reasoning3"] = servegen_trace(
        shared_traces() / "servegen_deepseek_r1", seed=32, start_s=8 * 3600.0,
        duration_s=30.0, rate_scale=0.3, max_output=4096,
    )  # fmt: skip
    return out


def build4() -> dict[str, Trace]:
    """The fourth set: high arrival rates (the loop's request intake)."""
    out: dict[str, Trace] = {}
    out["highrate"] = synth(
        "short chat completions at a high arrival rate", arrival="poisson", rate=100.0,
        duration_s=20.0, prompt_len="lognormal:300:0.5:2000", output_len="lognormal:60:0.5:300",
        seed=41,
    )  # fmt: skip
    az = read_trace(ROOT / "traces" / "azure_conv.parquet")
    out["azure_x10"] = window(az, 600.0, 20.0, 10.0, "traces/azure_conv.parquet")
    return out


def calib_specpen() -> Path:
    """traces/fidelity/specdec_pen.parquet (module docstring)."""
    t = read_trace(ROOT / "traces" / "specdec.parquet")
    hist = np.arange(len(t)) % 2 == 1
    t = dataclasses.replace(t, needs_history=hist)
    t.metadata["description"] = (
        f"{t.metadata.get('description', '')}; every other request needs its output history "
        "(penalties), for history_host"
    )
    return write_trace(t, ROOT / "traces" / "fidelity" / "specdec_pen.parquet")


def calib_ramp() -> Path:
    """traces/fidelity/ramp.parquet: the CPU phases' envelope run (2026-11-28). 512 short-prompt
    requests queued at once (run with arrival=asap), outputs spread evenly over 32-2048 tokens:
    the batch fills to max_num_seqs, then drains to one row, so one short run times every CPU
    phase at every batch size. The calibration run (azure45x4) never leaves batches below 32,
    and the phases' per-row costs extrapolated from there miss by 2-3x at 128-256 rows
    (reports/fidelity/README.md section N). Synthetic lengths, no check's data."""
    t = synth(
        "CPU phases' envelope: the batch fills to max_num_seqs and drains (run with arrival=asap)",
        arrival="fixed", rate=1000.0, num_requests=512, prompt_len="lognormal:300:0.5:1500",
        output_len="uniform:32:2048", seed=51,
    )  # fmt: skip
    return write_trace(t, ROOT / "traces" / "fidelity" / "ramp.parquet")


def calib_ramp_long() -> Path:
    """traces/fidelity/ramp_long.parquet: the ramp with ~1.9k-token prompts (384 requests,
    outputs 32-768, run with arrival=asap): ~2.2k context tokens a row at 128-256 rows, where the
    short ramp holds ~0.6k, so an envelope fit can tell a phase's per-context cost from its
    per-row cost (reports/fidelity/README.md section N)."""
    t = synth(
        "CPU phases' envelope with long contexts (run with arrival=asap)", arrival="fixed",
        rate=1000.0, num_requests=384, prompt_len="lognormal:1800:0.3:5000",
        output_len="uniform:32:768", seed=52,
    )  # fmt: skip
    return write_trace(t, ROOT / "traces" / "fidelity" / "ramp_long.parquet")


def main(out: Path = OUT, which: str = "1") -> None:
    out.mkdir(parents=True, exist_ok=True)
    sets = {"1": build, "2": build2, "3": build3, "4": build4}
    if which not in sets:
        raise SystemExit(f"make_checks.py: unknown set {which!r} (1, 2, 3 or 4)")
    for name, t in sets[which]().items():
        write_trace(t, out / f"{name}.parquet")
        print(
            f"{name:12} {len(t):5d} req  span {t.arrival_s.max():6.1f} s  "
            f"prompt mean {t.prompt_len.mean():7.0f} max {t.prompt_len.max():6d}  "
            f"output mean {t.output_len.mean():6.0f} max {t.output_len.max():6d}"
        )


if __name__ == "__main__":
    arg = sys.argv[1] if len(sys.argv) > 1 else "1"
    extra = {"calib": calib_specpen, "ramp": calib_ramp, "ramp_long": calib_ramp_long}
    if arg in extra:
        print(extra[arg]())
        raise SystemExit(0)
    main({"2": OUT2, "3": OUT3, "4": OUT4}.get(arg, OUT), arg)
