"""Prefill and mixed steps with `cuda_graphs_mixed` off (eager) and on (one graph replay per
step, engine.mixed_graphs): the host time of the step's phases and its GPU time; print a table.

    python bench/mixed_graphs.py [--model llama3.2-1b] [--cases 0:0:512,0:0:2048,32:1000:544]
                                 [--steps 16] [--depth 1] [--json PATH]

A case D:C:B runs the engine (random weights, greedy) with max_num_batched_tokens = B on D
requests decoding at a context of about C tokens while long prompts arrive one after another,
so every measured step holds the D decode rows and one prefill chunk of B - D tokens (the
chunked-prefill steady state). Per step, from the engine's own hooks (engine.hooks): the host
ms of prepare_inputs, launch (the forward's issue: ~140 kernel launches eagerly, one replay
with graphs) and sample, and the GPU interval between the step's first and last GPU work (CUDA
events). Depth 1 (default) keeps the host wait out of the GPU interval. Also reported for the
switch on: the start-up capture time and the graph pool's memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bubblesim.core import phases as P  # noqa: E402
from bubblesim.core.config import Config  # noqa: E402
from engine.engine import Engine, build_model  # noqa: E402
from engine.requests import RequestInput  # noqa: E402

PHASES = (P.PREPARE_INPUTS, P.LAUNCH, P.SAMPLE)


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        d, c, b = (int(x) for x in item.split(":"))
        if b <= d:
            raise SystemExit(f"--cases {item!r}: the token budget must exceed the decodes")
        out.append((d, c, b))
    return out


def run_case(cfg: Config, model, case, steps: int) -> dict:
    """Serve the case on one engine; the medians of the steady mixed steps."""
    d, ctx, budget = case
    eng = Engine(cfg, model)
    chunk = budget - d
    for i in range(d):  # decodes that outlive the measurement
        eng.add_request(RequestInput(f"d{i}", max(ctx, 1), 8 * steps + 64))
    # prompts of 8 whole chunks each: every step after the decodes' prefill is one chunk
    longs = [eng.add_request(RequestInput(f"p{i}", 8 * chunk, 1)) for i in range(steps // 8 + 2)]
    eng.start()
    while any(eng.states[i].finish_ns < 0 for i in longs):
        eng.step()
    trace = eng.finish()
    want = [
        i
        for i, s in enumerate(trace.shapes)
        if s.num_prefill_reqs == 1 and s.prefill_tokens == chunk and s.decode_tokens == d
    ][-steps:]
    out: dict = {"steps": len(want)}
    for p in PHASES:
        k = P.CPU_PHASES.index(p)
        ms = (trace.phase_ns[want, k, 1] - trace.phase_ns[want, k, 0]) / 1e6
        out[f"{p}_ms"] = float(np.median(ms)) if want else float("nan")
    gpu = (trace.gpu_ns[want, 1] - trace.gpu_ns[want, 0]) / 1e6
    out["gpu_ms"] = float(np.median(gpu)) if want else float("nan")
    out["host_ms"] = sum(out[f"{p}_ms"] for p in PHASES)
    if eng.mixed is not None and eng.mixed.graphs:
        out["capture_s"] = eng.mixed.capture_s
        out["pool_mib"] = eng.mixed.pool_bytes / 2**20
        out["graphs"] = len(eng.mixed.graphs)
    del eng
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--cases", default="0:0:512,0:0:2048,32:1000:544,64:1000:2048")
    ap.add_argument("--steps", type=int, default=16, help="measured mixed steps per case")
    ap.add_argument("--depth", type=int, default=1, help="batches_in_flight")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/mixed_graphs.py needs CUDA (graphs are captured on the GPU)")
    cases = parse_cases(args.cases)
    base = Config(
        model=args.model, device="cuda", max_num_seqs=256, max_model_len=32768,
        batches_in_flight=args.depth, gc_freeze=False, arrival="asap", num_kv_blocks=0,
        kv_memory_fraction=0.5,
    )  # fmt: skip
    model = None
    results = []
    print(f"{'case D:C:B':>14} {'graphs':>6} {'steps':>5} {'prep ms':>8} {'launch ms':>9} "
          f"{'sample ms':>9} {'host ms':>8} {'GPU ms':>8}  start-up")  # fmt: skip
    for case in cases:
        for on in (False, True):
            cfg = base.replace(max_num_batched_tokens=case[2], cuda_graphs_mixed=on)
            if model is None:
                model = build_model(cfg, 32768)
            r = {"case": ":".join(map(str, case)), "mixed_graphs": on,
                 **run_case(cfg, model, case, args.steps)}  # fmt: skip
            results.append(r)
            extra = ""
            if "capture_s" in r:
                extra = f"{r['graphs']} graphs {r['capture_s']:.1f} s, {r['pool_mib']:.0f} MiB"
            print(f"{r['case']:>14} {'on' if on else 'off':>6} {r['steps']:>5} "
                  f"{r['prepare_inputs_ms']:>8.3f} {r['launch_ms']:>9.3f} {r['sample_ms']:>9.3f} "
                  f"{r['host_ms']:>8.3f} {r['gpu_ms']:>8.3f}  {extra}")  # fmt: skip
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; medians over the measured steps; depth {args.depth}")
    if args.json:
        meta = {"device": dev, "model": args.model, "depth": args.depth, "steps": args.steps}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
