"""Time the paged decode attention kernel and a full decode forward; print a table.

    python bench/kernels.py [--model llama3-8b] [--json PATH] [--quick]

On CUDA every timing replays a CUDA graph (no launch overhead); the eager forward is shown too.
Attention rows report the KV bytes read per call and the achieved bandwidth against the GPU's
datasheet (bubblesim.core.gpus). `--device cpu --model tiny` (torch backend, or `--backend triton`
under
TRITON_INTERPRET=1) only checks that the script runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bubblesim.core.gpus import GPUS  # noqa: E402
from bubblesim.core.models import get_model  # noqa: E402
from engine.attention import AttentionMetadata, PagedAttention  # noqa: E402
from engine.model import LlamaModel, allocate_kv_cache  # noqa: E402

BLOCK_SIZE = 16
DECODE_CASES = [(1, 512), (1, 8192), (8, 2048), (64, 512), (64, 2048), (256, 512)]
QUICK_CASES = [(1, 512), (64, 512)]
FORWARD_BATCHES = [1, 8, 64]
SWEEP_CASES = [(1, 512), (1, 2048), (1, 8192), (8, 512), (8, 2048), (32, 512), (64, 512),
               (64, 2048), (256, 512)]  # fmt: skip


def time_ms(fn, device: torch.device, iters: int, graph: bool) -> float:
    """Mean milliseconds per call of `fn` (after warm-up)."""
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def decode_metadata(batch: int, context: int, device, seed: int = 0):
    """`batch` one-token decodes with `context` tokens each, on shuffled blocks."""
    per_seq = -(-context // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    attn = AttentionMetadata.from_lists([1] * batch, [context] * batch, blocks.tolist(),
                                        BLOCK_SIZE, device)  # fmt: skip
    return attn, batch * per_seq


def bench_attention(spec, cases, dtype, device, backend_name, iters, peak_gb_s) -> list[dict]:
    rows = []
    backend = PagedAttention(backend_name, device)
    for batch, context in cases:
        attn, num_blocks = decode_metadata(batch, context, device)
        kv = torch.randn((2, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim),
                         dtype=dtype, device=device)  # fmt: skip
        q = torch.randn(batch, spec.num_heads, spec.head_dim, dtype=dtype, device=device)
        k = torch.randn(batch, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
        call = functools.partial(backend, q, k, k, kv, attn, spec.head_dim**-0.5)
        ms = time_ms(call, device, iters, graph=device.type == "cuda")
        kv_bytes = 2 * batch * context * spec.kv_size * kv.element_size()
        gb_s = kv_bytes / ms / 1e6
        rows.append({
            "kind": "decode_attention", "batch": batch, "context": context,
            "backend": backend.backend, "us": round(ms * 1e3, 2),
            "kv_mb": round(kv_bytes / 1e6, 2), "gb_per_s": round(gb_s, 1),
            "pct_peak_bw": round(100 * gb_s / peak_gb_s, 1) if peak_gb_s else None,
        })  # fmt: skip
    return rows


def decode_step(model, ids, pos, attn, cache) -> torch.Tensor:
    return model.compute_logits(model(ids, pos, attn, cache))


def bench_forward(spec, batches, context, dtype, device, backend, iters, peak_gb_s) -> list[dict]:
    model = LlamaModel(spec, dtype, device, backend, max_positions=context + 1).init_random(0)
    rows = []
    for batch in batches:
        attn, num_blocks = decode_metadata(batch, context, device)
        cache = allocate_kv_cache(spec, num_blocks, BLOCK_SIZE, dtype, device)
        ids = torch.randint(0, spec.vocab_size, (batch,), device=device)
        pos = torch.full((batch,), context - 1, device=device)
        step = functools.partial(decode_step, model, ids, pos, attn, cache)
        with torch.inference_mode():
            eager = time_ms(step, device, iters, graph=False)
            graphed = time_ms(step, device, iters, graph=True) if device.type == "cuda" else eager
        weight_bytes = spec.decode_weight_bytes(str(dtype).removeprefix("torch."))
        gb_s = weight_bytes / graphed / 1e6
        rows.append({
            "kind": "decode_forward", "batch": batch, "context": context,
            "backend": model.attn_backend, "eager_ms": round(eager, 3),
            "graph_ms": round(graphed, 3), "weight_gb_per_s": round(gb_s, 1),
            "pct_peak_bw": round(100 * gb_s / peak_gb_s, 1) if peak_gb_s else None,
        })  # fmt: skip
    return rows


def _copies(nbytes: int, total: int = 256 << 20, most: int = 64) -> int:
    """Input copies to rotate through so that repeated calls do not hit in L2."""
    return max(1, min(most, -(-total // max(nbytes, 1))))


def _attention_calls(kind, q, k, kv, attn, scale, out, splits, block_n, warps, max_seq):
    """One call per KV copy in `kv` [n, 2, ...] (old general kernel or the decode kernel)."""
    # lazy: Triton only when benchmarked (the torch backend runs without it)
    from engine.kernels import decode_attention, paged_attention

    for i in range(kv.shape[0]):
        if kind == "general":
            paged_attention(q, kv[i, 0], kv[i, 1], attn.query_start_loc, attn.seq_lens,
                            attn.block_tables, 1, max_seq, scale, out=out)  # fmt: skip
        else:
            decode_attention(q, k, k, kv[i, 0], kv[i, 1], attn.query_start_loc, attn.seq_lens,
                             attn.block_tables, max_seq, scale, slot_mapping=attn.slot_mapping,
                             out=out, num_splits=splits, block_n=block_n,
                             num_warps=warps)  # fmt: skip


def bench_attention_sweep(spec, cases, dtype, device, iters) -> list[dict]:
    """Decode attention variants (old general kernel vs the decode kernel at several split
    counts, tile sizes and warps), each timed over rotating KV copies (cold L2, like a layer)."""
    rows = []
    scale = spec.head_dim**-0.5
    variants = [("general", 0, 0, 0, "ctx"), ("general", 0, 0, 0, "131072"),
                ("decode", 0, 64, 4, "131072")]  # fmt: skip
    for splits in (1, 2, 4, 8, 16, 32):
        variants.append(("decode", splits, 64, 4, "131072"))
        variants.append(("decode", splits, 32, 4, "131072") if splits >= 4 else
                        ("decode", splits, 64, 8, "131072"))  # fmt: skip
    for batch, context in cases:
        attn, num_blocks = decode_metadata(batch, context, device)
        kv_bytes = 2 * batch * context * spec.kv_size * 2
        n = _copies(kv_bytes)
        kv = torch.randn((n, 2, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim),
                         dtype=dtype, device=device)  # fmt: skip
        q = torch.randn(batch, spec.num_heads, spec.head_dim, dtype=dtype, device=device)
        k = torch.randn(batch, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
        out = torch.empty_like(q)
        for kind, splits, block_n, warps, bound in variants:
            if kind == "decode" and splits > 1 and -(-context // block_n) < splits:
                continue  # more splits than tiles: the same as fewer
            max_seq = context if bound == "ctx" else 131072
            call = functools.partial(_attention_calls, kind, q, k, kv, attn, scale, out, splits,
                                     block_n, warps, max_seq)  # fmt: skip
            ms = time_ms(call, device, max(5, iters // n), graph=True) / n
            rows.append({
                "kind": "attention_sweep", "batch": batch, "context": context,
                "variant": f"{kind} s={splits or 'auto'} n={block_n or 'auto'} w={warps or 'auto'}"
                           f" max_seq={bound}",
                "us": round(ms * 1e3, 2), "gb_per_s": round(kv_bytes / ms / 1e6, 1),
            })  # fmt: skip
        del kv
    return rows


GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
               "down": (4096, 14336), "lm_head": (128256, 4096)}  # fmt: skip
GEMM_CONFIGS = [  # (block_n, block_k, num_stages, num_warps)
    (16, 512, 3, 4), (32, 256, 4, 4), (32, 256, 6, 4), (64, 128, 6, 4), (64, 256, 4, 8),
    (128, 128, 4, 8),
]  # fmt: skip


def _gemm_calls(fn, x, ws) -> None:
    for w in ws:
        fn(x, w)


def bench_gemm(batches, dtype, device, iters) -> list[dict]:
    """cuBLAS (F.linear) vs the Triton skinny GEMM at the llama3-8b decode shapes."""
    from engine.kernels.skinny_gemm import skinny_gemm  # lazy: Triton only when benchmarked

    rows = []
    for name, (n_out, k_in) in GEMM_SHAPES.items():
        w_bytes = n_out * k_in * 2
        c = _copies(w_bytes)
        ws = [torch.randn(n_out, k_in, dtype=dtype, device=device) * 0.02 for _ in range(c)]
        for m in batches:
            x = torch.randn(m, k_in, dtype=dtype, device=device)
            ref = F.linear(x.double(), ws[0].double())
            variants = [("cublas", None)] + [("triton", cfg) for cfg in GEMM_CONFIGS]
            for kind, cfg in variants:
                if kind == "triton" and m > 16:
                    continue
                if kind == "cublas":
                    fn = F.linear
                else:
                    fn = functools.partial(skinny_gemm, config=cfg)
                err = ((fn(x, ws[0]).double() - ref).norm() / ref.norm()).item()

                call = functools.partial(_gemm_calls, fn, x, ws)
                ms = time_ms(call, device, max(5, iters // c), graph=True) / c
                rows.append({
                    "kind": "gemm", "shape": name, "m": m, "variant": kind if cfg is None
                    else "triton n={} k={} st={} w={}".format(*cfg),
                    "us": round(ms * 1e3, 2), "gb_per_s": round(w_bytes / ms / 1e6, 1),
                    "rel_err": f"{err:.1e}",
                })  # fmt: skip
        del ws
    return rows


def _site_calls(kind, x, ws) -> None:
    from engine.kernels import skinny_gemm  # lazy: Triton only when benchmarked

    for w in ws:
        skinny_gemm(x, w, silu_mul=kind == "silu", out_dtype=torch.float32 if kind == "fp32"
                    else None)  # fmt: skip


def bench_gemm_sites(m, dtype, device, iters) -> list[dict]:
    """The model's skinny-GEMM call sites at M = m, default configs: the epilogue variants vs
    the plain kernel on the same weights (what each fusion costs)."""
    sites = [("gate_up", "silu"), ("lm_head", "fp32")]
    rows = []
    for name, fused in sites:
        n_out, k_in = GEMM_SHAPES[name]
        w_bytes = n_out * k_in * 2
        c = _copies(w_bytes)
        ws = [torch.randn(n_out, k_in, dtype=dtype, device=device) * 0.02 for _ in range(c)]
        x = torch.randn(m, k_in, dtype=dtype, device=device)
        for kind in ("plain", fused):
            call = functools.partial(_site_calls, kind, x, ws)
            ms = time_ms(call, device, max(5, iters // c), graph=True) / c
            rows.append({"kind": "gemm_site", "shape": name, "m": m, "variant": kind,
                         "us": round(ms * 1e3, 2),
                         "gb_per_s": round(w_bytes / ms / 1e6, 1)})  # fmt: skip
        del ws
    return rows


def print_table(rows: list[dict]) -> None:
    for kind in dict.fromkeys(r["kind"] for r in rows):
        part = [r for r in rows if r["kind"] == kind]
        cols = [c for c in part[0] if c != "kind"]
        widths = [max(len(c), *(len(str(r[c])) for r in part)) for c in cols]
        print(f"\n{kind}")
        print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
        for r in part:
            print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", help="preset name or checkpoint folder")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", choices=["triton", "torch"], help="default: by device")
    p.add_argument("--context", type=int, default=512, help="context of the forward rows")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="fewer cases")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--sweep", action="store_true", help="attention variants (CUDA)")
    p.add_argument("--gemm", action="store_true", help="cuBLAS vs Triton skinny GEMM (CUDA)")
    p.add_argument("--gemm-sites", action="store_true", help="skinny GEMM fusions (CUDA)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    spec = get_model(args.model)
    if device.type == "cuda":
        dtype, gpu = torch.bfloat16, torch.cuda.get_device_name(device)
        preset = next((g for name, g in GPUS.items() if name in gpu.lower()), None)
        peak = preset.hbm_gb_per_s if preset else None
    else:
        dtype, gpu, peak = torch.float32, "cpu", None
        if args.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            print("error: --backend triton on cpu needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
    cases = QUICK_CASES if args.quick or device.type != "cuda" else DECODE_CASES
    batches = FORWARD_BATCHES[:2] if args.quick or device.type != "cuda" else FORWARD_BATCHES
    print(f"model {spec.name}, {gpu}, {dtype}, block_size {BLOCK_SIZE}")
    if args.sweep or args.gemm or args.gemm_sites:
        rows = []
        if args.gemm_sites:
            rows += bench_gemm_sites(1, dtype, device, args.iters)
        if args.sweep:
            rows += bench_attention_sweep(spec, SWEEP_CASES, dtype, device, args.iters)
        if args.gemm:
            rows += bench_gemm([1, 8], dtype, device, args.iters)
        print_table(rows)
        if args.json:
            out = {"model": spec.name, "device": gpu, "dtype": str(dtype), "rows": rows}
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return 0
    rows = bench_attention(spec, cases, dtype, device, args.backend, args.iters, peak)
    rows += bench_forward(
        spec, batches, args.context, dtype, device, args.backend, args.iters, peak
    )
    print_table(rows)
    if args.json:
        out = {"model": spec.name, "device": gpu, "dtype": str(dtype), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
