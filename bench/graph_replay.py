"""GPU time of a decode CUDA graph replayed one at a time (as with 1 batch in flight) or back to
back (as with 2 in flight); print a table.

    python bench/graph_replay.py [--model llama3.2-1b] [--batch 8] [--context 1000] [--json PATH]

Measured replays of fidelity set C/H100 show the engine's decode GPU interval 15-22 % shorter at
depth 1 than at depth 2 for the same batch. This separates candidates on the bare model graph:
- `sync`: replay, then synchronize (the GPU is idle when each replay is launched);
- `b2b same`: the same graph replayed back to back, events between replays;
- `b2b alternating`: two captures of the same step alternated (a graph never follows itself);
- `b2b paced`: back to back, the host issuing each replay `--pace-ms` after the previous one
  (launches arrive while the GPU runs the previous replay, as the engine's loop does).
Each row: median GPU ms per replay over `--iters` replays (CUDA events). Run it with
ENGINE_PDL=0 as well to see whether programmatic dependent launch is involved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bubblesim.core.models import get_model  # noqa: E402
from engine.attention import AttentionMetadata  # noqa: E402
from engine.model import LlamaModel, allocate_kv_cache  # noqa: E402

BLOCK = 16


def capture(step) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    g.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    return g


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def timed(graphs: list[torch.cuda.CUDAGraph], iters: int, sync: bool, pace_ms: float) -> float:
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    torch.cuda.synchronize()
    ev[0].record()
    for i in range(iters):
        if sync:
            torch.cuda.synchronize()
            ev[i].record()  # the GPU is idle: the event marks this replay's start
        graphs[i % len(graphs)].replay()
        ev[i + 1].record()
        if pace_ms:
            spin(pace_ms)
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(iters))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--pace-ms", type=float, default=0.6)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    spec = get_model(args.model)
    model = LlamaModel(spec, torch.bfloat16, "cuda", max_positions=args.context + 64)
    model.init_random(0)
    b, per = args.batch, -(-args.context // BLOCK)
    cache = allocate_kv_cache(spec, b * per + 1, BLOCK, torch.bfloat16, "cuda")
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    attn = AttentionMetadata.from_lists([1] * b, [args.context] * b, tables, BLOCK, "cuda")
    attn.slot_mapping.fill_(-1)  # write no KV: every replay reads the same cache
    ids = torch.zeros(b, dtype=torch.int32, device="cuda")
    pos = torch.full((b,), args.context - 1, dtype=torch.int32, device="cuda")

    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, pos, attn, cache))

    with torch.no_grad():
        g1, g2 = capture(step), capture(step)
        rows = {
            "sync": timed([g1], args.iters, True, 0.0),
            "b2b same": timed([g1], args.iters, False, 0.0),
            "b2b alternating": timed([g1, g2], args.iters, False, 0.0),
            f"b2b paced {args.pace_ms} ms": timed([g1], args.iters, False, args.pace_ms),
            f"b2b paced {args.pace_ms} ms alternating": timed(
                [g1, g2], args.iters, False, args.pace_ms
            ),
        }
    name = torch.cuda.get_device_name()
    pdl = os.environ.get("ENGINE_PDL", "1")
    print(f"{spec.name}, batch {b}, context {args.context}, {name}, ENGINE_PDL={pdl}")
    for k, v in rows.items():
        print(f"  {k:34s} {v:.4f} ms per replay")
    if args.json:
        doc = {"model": spec.name, "device": name, "batch": b, "context": args.context,
               "pdl": pdl, "ms_per_replay": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
