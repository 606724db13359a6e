"""Where a replayed step's GPU interval goes: the forward's own span against the time from the
forward's end to the step's end event, at 1 and 2 batches in flight; print a table.

    python bench/step_anatomy.py [--trace traces/fidelity/azure6.parquet] [--model llama3.2-1b]
                                 [--depths 1,2] [--json PATH]

The replay hooks time a step's GPU work from a start event (recorded before its input copies;
moved to the launch when the GPU was idle) to an end event recorded after the host's `sample`
phase has enqueued the step's last work. With 2 batches in flight the measured decode interval
is 15-22 % longer than with 1 at equal batch size (reports/fidelity/README.md, depth 1). This
diagnostic (not part of a measured run: it adds events) records, per step, one event right
before and one right after the forward (a CUDA graph replay for decode) and one right after the
hooks' end event, all on the compute stream, and reports for decode-graph steps (medians, ms):
- `fwd`: before-forward -> after-forward: the forward's span once the GPU reached it;
- `tail`: after-forward -> after-end: the step's work after the forward (the token copy), plus
  any wait for the host to enqueue it; if the interval's excess at depth 2 lives here, the GPU
  idles inside what the hooks call the step's GPU time;
- `lead`: previous step's after-end -> this step's before-forward: input copies and any wait
  for the host's launch.
On CPU it only checks that the script runs (no events). Written 2026-11-26 after the device
budget of that session was spent: it has run on CPU only, not yet on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bubblesim.core.config import load_config  # noqa: E402
from replay.gpu.run import check_trace, new_engine, warm_up  # noqa: E402


def anatomy(model: str, trace: str, depth: int, blocks: int, device: str = "cuda") -> dict:
    sets = [f"model={model}", f"num_kv_blocks={blocks}", f"batches_in_flight={depth}"]
    cfg = load_config(None, [*sets, f"device={device}"])
    tr = check_trace(cfg, trace)
    engine, _ = new_engine(cfg, None)
    warm_up(engine)
    cuda = engine.device.type == "cuda"
    marks: list[list] = []  # per forward: [graph?, before, after, end]
    forward, gpu_end = engine.forward, engine.hooks.gpu_end

    def event():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def timed_forward(step):
        before = event() if cuda else None
        out = forward(step)
        marks.append([bool(step.bucket), before, event() if cuda else None, None])
        return out

    def timed_end(row):
        gpu_end(row)
        if marks and marks[-1][3] is None:
            marks[-1][3] = event() if cuda else None

    engine.forward, engine.hooks.gpu_end = timed_forward, timed_end
    engine.run(tr)
    if cuda:
        torch.cuda.synchronize()
    fwd, tail, lead = [], [], []
    for prev, (graph, before, after, end) in zip([None, *marks], marks, strict=False):
        if not (cuda and graph and end is not None):
            continue
        fwd.append(before.elapsed_time(after))
        tail.append(after.elapsed_time(end))
        if prev is not None and prev[3] is not None:
            lead.append(prev[3].elapsed_time(before))

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 4) if xs else None

    p90 = round(sorted(tail)[int(0.9 * len(tail))], 4) if tail else None
    return {
        "depth": depth, "graph_steps": len(fwd), "steps": len(marks),
        "fwd_ms": med(fwd), "tail_ms": med(tail), "lead_ms": med(lead), "tail_p90_ms": p90,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="traces/fidelity/azure6.parquet")
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--blocks", type=int, default=40000)
    p.add_argument("--depths", default="1,2")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA (on CPU there are no device events to read)")
        return 0
    rows = [anatomy(args.model, args.trace, int(d), args.blocks) for d in args.depths.split(",")]
    name = torch.cuda.get_device_name()
    print(f"{args.model} on {name}, {args.trace}: decode-graph steps, medians in ms")
    for r in rows:
        print(
            f"  depth {r['depth']}: {r['graph_steps']} of {r['steps']} steps; forward "
            f"{r['fwd_ms']}, tail {r['tail_ms']} (p90 {r['tail_p90_ms']}), lead {r['lead_ms']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
