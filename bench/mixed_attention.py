"""Paged attention of mixed batches (prefill chunks beside decodes), one layer's call, with and
without the decode splits of long one-token rows; print a table.

    python bench/mixed_attention.py [--model llama3-8b] [--json PATH] [--iters 20]

Each case is a mixed batch: `decodes` one-token rows of `context` keys, `long` one-token rows
of `long_context` keys, and one prefill chunk of `chunk` tokens after `chunk_context` keys.
"before" forces decode_splits=1 (each one-token row walks its whole context in one program per
kv head, as this kernel did before the decode splits), "after" lets the wrapper choose. Timed
as CUDA-graph replays (kernels only). On CPU (`--device cpu`, TRITON_INTERPRET=1) only a tiny
case runs, to check the script.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import BLOCK_SIZE, time_ms  # noqa: E402
from bubblesim.core.models import get_model  # noqa: E402
from engine.attention import AttentionMetadata  # noqa: E402
from engine.kernels import paged_attention  # noqa: E402

# (decodes, context, long, long_context, chunk, chunk_context)
CASES = [
    (100, 2000, 0, 0, 512, 0),  # control: no long context, no split either way
    (100, 2000, 1, 38000, 512, 0),
    (100, 2000, 1, 38000, 2048, 0),
    (30, 2000, 1, 38000, 256, 0),
    (90, 2000, 10, 30000, 1024, 0),
    (100, 2000, 0, 0, 2048, 30000),  # a long prefill chunk: decode rows short
    (8, 1000, 1, 16000, 512, 0),
]
CPU_CASES = [(3, 40, 1, 300, 20, 0)]


def mixed_metadata(case: tuple[int, ...], device: torch.device) -> tuple[AttentionMetadata, int]:
    decodes, ctx, long, long_ctx, chunk, chunk_ctx = case
    q_lens = [1] * (decodes + long) + [chunk]
    seq_lens = [ctx] * decodes + [long_ctx] * long + [chunk_ctx + chunk]
    tables, next_block = [], 0
    for s in seq_lens:
        n = -(-s // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    attn = AttentionMetadata.from_lists(q_lens, seq_lens, tables, BLOCK_SIZE, device)
    return attn, next_block


def bench_case(spec, case, dtype, device, iters) -> dict:
    attn, num_blocks = mixed_metadata(case, device)
    t = int(attn.query_start_loc[-1])
    kv = torch.randn((2, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim),
                     dtype=dtype, device=device)  # fmt: skip
    q = torch.randn(t, spec.num_heads, spec.head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    scale = spec.head_dim**-0.5

    def call(decode_splits: int):
        return lambda: paged_attention(
            q, kv[0], kv[1], attn.query_start_loc, attn.seq_lens, attn.block_tables,
            attn.max_query_len, attn.max_seq_len, scale, out=out, decode_splits=decode_splits,
        )  # fmt: skip

    cuda = device.type == "cuda"
    before = time_ms(call(1), device, iters, graph=cuda)
    after = time_ms(call(0), device, iters, graph=cuda)
    decodes, ctx, long, long_ctx, chunk, chunk_ctx = case
    return {
        "decodes": decodes, "context": ctx, "long": long, "long_context": long_ctx,
        "chunk": chunk, "chunk_context": chunk_ctx,
        "before_us": round(before * 1e3, 1), "after_us": round(after * 1e3, 1),
        "speedup": round(before / after, 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    spec = get_model(args.model)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    rows = [bench_case(spec, c, dtype, device, args.iters) for c in (CASES if cuda else CPU_CASES)]
    print(f"model {spec.name}, {gpu}, {dtype}: one layer's paged attention, us per call")
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if args.json:
        doc = {"model": spec.name, "device": gpu, "dtype": str(dtype), "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
