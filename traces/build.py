"""Regenerate every bundled trace in this folder: `python traces/build.py [NAME ...]`.

Reads the public source data in `traces/` of the shared data folder: $BUBBLESIM_SHARED when
set, else the repository's own `shared/` when it has one, else the `shared/` folder beside the
repository; exits 1 with one line naming the folder when it is absent. Same Python version, same
bytes: every draw is seeded, and the token-id traces take their text from this Python's
standard library (the version is recorded in each trace's metadata).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bubblesim.core.scenario import SCENARIO_KEY, parse_scenario  # noqa: E402
from bubblesim.core.trace import Trace, trace_sha256, write_trace  # noqa: E402
from bubblesim.workloads.importers import import_azure  # noqa: E402
from bubblesim.workloads.lengths import parse_length  # noqa: E402
from bubblesim.workloads.mooncake import import_mooncake  # noqa: E402
from bubblesim.workloads.servegen import servegen_trace  # noqa: E402
from bubblesim.workloads.synth import SynthSpec, synthesize  # noqa: E402

MAX_TOTAL_LEN = 131_072  # the context of every model preset


def shared_traces() -> Path:
    """The public source data: $BUBBLESIM_SHARED/traces, else ROOT/shared/traces, else
    ROOT/../shared/traces; exits 1 with one line when the chosen folder is absent."""
    env = os.environ.get("BUBBLESIM_SHARED")
    if env:
        cands = [Path(env) / "traces"]
    else:
        cands = [ROOT / "shared" / "traces", ROOT.parent / "shared" / "traces"]
    for cand in cands:
        if cand.is_dir():
            return cand
    print(
        f"error: public source data not found (looked in {' and '.join(map(str, cands))}; "
        "set BUBBLESIM_SHARED to the folder that holds traces/)",
        file=sys.stderr,
    )
    raise SystemExit(1)


def synth(description: str, **kw: object) -> Callable[[Path], Trace]:
    def make(_: Path) -> Trace:
        for key in ("prompt_len", "output_len"):
            if isinstance(kw.get(key), (str, int)):
                kw[key] = parse_length(str(kw[key]))
        trace = synthesize(SynthSpec(**kw))  # type: ignore[arg-type]
        trace.metadata["description"] = description + "; " + trace.metadata["description"]
        return trace

    return make


def azure(src: Path) -> Trace:
    return import_azure(src / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv")


def mooncake(src: Path) -> Trace:
    trace, _ = import_mooncake(src / "mooncake_fast25" / "synthetic_trace.jsonl", MAX_TOTAL_LEN)
    return trace


def reasoning(src: Path) -> Trace:
    # noon of the ServeGen day: the window with the longest reasoning outputs (mean ~2.3k,
    # p99 ~16k); one tenth of the production rate (~1.2 req/s) so one GPU can keep up
    trace = servegen_trace(src / "servegen_deepseek_r1", 0, 43_200, 600, rate_scale=0.1)
    trace.metadata["description"] = (
        "long-output reasoning (DeepSeek-R1, ServeGen), needs_history on every request; "
        + trace.metadata["description"]
    )
    return trace


SPEC_IDS = dict(token_ids=True, prompt_len="uniform:256:1024")
TRACES: dict[str, Callable[[Path], Trace]] = {
    "smoke": synth(
        "smoke test for engine and sim (fits the tiny model)",
        num_requests=40,
        rate=10.0,
        prompt_len="uniform:16:200",
        output_len="uniform:8:64",
        needs_history=0.15,
        token_ids=True,
        seed=1,
    ),
    "azure_conv": azure,
    "mooncake": mooncake,
    "reasoning": reasoning,
    "specdec": synth(
        "speculative decoding on real text (Poisson arrivals)",
        num_requests=64,
        rate=2.0,
        output_len="uniform:128:512",
        seed=5,
        **SPEC_IDS,
    ),
    "seed1_backup_tokens": synth(
        "seed 1 (PR 41043, preallocated backup tokens): spec decode, 64 concurrent",
        num_requests=64,
        arrival="burst",
        output_len=512,
        seed=11,
        **SPEC_IDS,
    ),
    "seed2_accept_count": synth(
        "seed 2 (PR 38372, accepted count by sum): spec decode, 32 concurrent",
        num_requests=32,
        arrival="burst",
        output_len=512,
        seed=12,
        **SPEC_IDS,
    ),
    "seed3_placeholder_scan": synth(
        "seed 3 (PR 42938, reverse placeholder scan): 128 concurrent, 4096 in / 60000 out",
        num_requests=128,
        arrival="burst",
        prompt_len=4096,
        output_len=60_000,
        needs_history=1.0,
        seed=13,
    ),
    "seed4_ngram": synth(
        "seed 4 (PR 29184, n-gram proposer on GPU): 16 concurrent, repetitive text for k=3",
        num_requests=16,
        arrival="burst",
        output_len=512,
        ngram_friendly=True,
        seed=14,
        **SPEC_IDS,
    ),
    "seed5_optimistic": synth(
        "seed 5 (PR 32951, optimistic spec decode): one request every 4 s (low concurrency)",
        num_requests=8,
        arrival="fixed",
        rate=0.25,
        output_len=512,
        seed=15,
        **SPEC_IDS,
    ),
}


# The config each seed trace shows its seed under (reports/whatif.md), stored in the trace as
# its scenario (bubblesim.core.scenario): `sim run` / `sim whatif` apply it below --config and
# --set.
# Seed 3's is the dense llama3.2-1b one: its reported-engine stand-in (seed3.toml) names a cost
# profile file, which a trace cannot carry.
SCENARIOS: dict[str, str] = {
    "seed1_backup_tokens": "reports/whatif/seed1.toml",
    "seed2_accept_count": "reports/whatif/seed2.toml",
    "seed3_placeholder_scan": "reports/whatif/seed3_dense.toml",
    "seed4_ngram": "reports/whatif/seed4.toml",
    "seed5_optimistic": "reports/whatif/seed5.toml",
}


def main(argv: list[str]) -> int:
    unknown = [n for n in argv if n not in TRACES]
    if unknown:
        print(f"error: unknown trace {unknown[0]!r} (known: {', '.join(TRACES)})", file=sys.stderr)
        return 2
    src = shared_traces()
    for name in argv or list(TRACES):
        trace = TRACES[name](src)
        trace.metadata["generator"] = f"traces/build.py {name}"
        if name in SCENARIOS:
            text = (ROOT / SCENARIOS[name]).read_text()
            parse_scenario(text, SCENARIOS[name])  # a bad config fails here, not in a run
            trace.metadata[SCENARIO_KEY] = text
        path = write_trace(trace, HERE / f"{name}.parquet")
        size_kib = path.stat().st_size / 1024
        print(
            f"{path.name:28s} {len(trace):7,} rows {size_kib:8,.0f} KiB  {trace_sha256(path)[:16]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
