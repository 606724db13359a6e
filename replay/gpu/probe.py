"""The host probe: a fixed small workload the engine serves just before a measured run.

The CPU side of an engine step (schedule, prepare, the eager launch of a prefill step, sample,
process outputs) runs at the host's speed, and that speed moves between hosts and between
minutes on one host (reports/fidelity/README.md: up to 1.5x on one H100 host within minutes).
A profile carries its calibration run's level; a prediction for another host or minute needs
that host's level, measured before the run, never read off the run it predicts.

The probe is the same engine on the same config serving PROBE_REQUESTS synthetic requests (prompts
of 64-2048 tokens, at most one step's token budget, 8-48 output tokens, one every PROBE_SPACING_S,
so it holds prefill, mixed and decode steps) with the run's hooks. `replay run` writes its step
records as the run folder `probe/` inside the run's folder (summary key `replay.host_probe`);
`python -m replay probe` runs it alone on a host. replay.analysis.probe turns a probe folder and a
profile into the host's level against the profile (measured / predicted CPU time over the probe's
own steps), and the ratio of two levels into the simulator's `host_scale`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from engine.requests import RequestInput
from replay.analysis.probe import PROBE_DIR, PROBE_TRACE

__all__ = ["PROBE_DIR", "probe_inputs", "probe_trace_info"]

PROBE_REQUESTS = 40
PROBE_REQUESTS_CPU = 8  # a CPU engine (tests, tiny models): 8 requests, prompts <= 128 tokens
PROBE_PROMPT_CPU = 128
PROBE_SPACING_S = 0.005  # arrival spacing (realtime runs; an asap run queues them all at once)
_PROMPTS = (96, 384, 1536, 160, 640, 2048, 64, 1024)
_OUTPUTS = (12, 32, 20, 48, 8, 24)
PROBE_KEY = 1 << 29  # request ids far from a trace's (keys are the engine's arrival ranks)


def probe_inputs(max_model_len: int, max_tokens: int, device: str) -> list[RequestInput]:
    """The probe's requests: the same for every host of a config. A prompt is cut to what one
    step's token budget and the model's context hold (it keeps at least one token); a CPU
    engine serves the first PROBE_REQUESTS_CPU of them, prompts cut to PROBE_PROMPT_CPU (its
    steps are 100x slower).
    """
    cuda = device == "cuda"
    n, cap = (PROBE_REQUESTS, max_tokens) if cuda else (PROBE_REQUESTS_CPU, PROBE_PROMPT_CPU)
    out = []
    for i in range(n):
        o = min(_OUTPUTS[i % len(_OUTPUTS)], max(1, max_model_len // 4))
        p = max(1, min(_PROMPTS[i % len(_PROMPTS)], max_model_len - o, max_tokens, cap))
        out.append(RequestInput(f"probe-{PROBE_KEY + i}", p, o, arrival_s=i * PROBE_SPACING_S))
    return out


def probe_trace_info(inputs: list[RequestInput]) -> dict[str, Any]:
    """summary.json's `trace` for a probe folder: no file; the digest names the request list."""
    text = ";".join(f"{r.prompt_len},{r.output_len},{r.arrival_s!r}" for r in inputs)
    return {
        "path": PROBE_TRACE,
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "rows": len(inputs),
    }
