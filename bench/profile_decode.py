"""Where a decode step's GPU time goes: kernel device time by kernel (torch.profiler) against
the CUDA-graph step time and the HBM floor.

    python bench/profile_decode.py [--model llama3-8b] [--batch 1] [--context 512]
        [--max-seq-len N] [--json PATH]

--max-seq-len is the attention bound the step is captured with (the engine's graphs use
max_model_len; default: the context, as an eager step would).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import decode_metadata, decode_step, time_ms  # noqa: E402

import engine.model  # noqa: E402
from bubblesim.core.models import get_model  # noqa: E402
from engine.model import LlamaModel, allocate_kv_cache  # noqa: E402


def copy_gb_s(device: torch.device) -> float:
    """Device-to-device copy bandwidth, counting bytes read + written."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), device, 20, graph=False)
    return 2 * n / ms / 1e6


def kernel_group(name: str) -> str:
    low = name.lower()
    if "nvjet" in low or "gemm" in low or "cutlass" in low or "splitk" in low:
        return "gemm"
    if "attention" in low or "reduce_splits" in low:
        return "attention"
    if "rms_norm" in low:
        return "norm"
    if "rope" in low or "write_kv" in low:
        return "rope+kv"
    return "other"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-seq-len", type=int, default=0, help="attention bound (default context)")
    p.add_argument("--skinny-rows", type=int, default=None,
                   help="override engine.model.SKINNY_MAX_ROWS (0 = cuBLAS path only)")  # fmt: skip
    p.add_argument("--skinny-silu", type=int, choices=[0, 1], default=None,
                   help="override engine.model.SKINNY_FUSE_SILU")  # fmt: skip
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.skinny_rows is not None:
        engine.model.SKINNY_MAX_ROWS = args.skinny_rows
    if args.skinny_silu is not None:
        engine.model.SKINNY_FUSE_SILU = bool(args.skinny_silu)
    device = torch.device("cuda")
    spec = get_model(args.model)
    dtype = torch.bfloat16
    model = LlamaModel(spec, dtype, device, "triton", max_positions=args.context + 1)
    model.init_random(0)
    attn, num_blocks = decode_metadata(args.batch, args.context, device)
    attn.max_seq_len = max(args.max_seq_len, args.context)
    cache = allocate_kv_cache(spec, num_blocks, 16, dtype, device).normal_()  # not zeros
    ids = torch.randint(0, spec.vocab_size, (args.batch,), device=device)
    pos = torch.full((args.batch,), args.context - 1, device=device)
    step = functools.partial(decode_step, model, ids, pos, attn, cache)
    with torch.inference_mode():
        graph_ms = time_ms(step, device, 50, graph=True)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
    by_name: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_name[ev.name[:80]] += ev.device_time / 5 / 1e3  # ms per step
            count[ev.name[:80]] += 1
    kernel_ms = sum(by_name.values())
    bw = copy_gb_s(device)
    kv_bytes = 2 * args.batch * args.context * spec.kv_size * 2 * spec.num_layers
    floor_ms = (spec.decode_weight_bytes("bfloat16") + kv_bytes) / bw / 1e6
    print(
        f"{args.model} batch {args.batch} context {args.context} on {torch.cuda.get_device_name()}"
    )
    print(
        f"graph step {graph_ms:.3f} ms; kernel sum {kernel_ms:.3f} ms; floor {floor_ms:.3f} ms "
        f"(copy {bw:.0f} GB/s); kernels/step {sum(count.values()) // 5}"
    )
    groups: dict[str, float] = defaultdict(float)
    for name, ms in by_name.items():
        groups[kernel_group(name)] += ms
    print("by group: " + ", ".join(f"{g} {ms:.3f}" for g, ms in sorted(groups.items())))
    print(f"{'ms/step':>8} {'share':>6} {'n':>4}  kernel")
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])
    for name, ms in rows[:20]:
        print(f"{ms:8.3f} {100 * ms / kernel_ms:5.1f}% {count[name] // 5:4d}  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "batch": args.batch, "graph_ms": graph_ms, "kernel_ms": kernel_ms,
            "floor_ms": floor_ms, "max_seq_len": attn.max_seq_len,
            "gpu": torch.cuda.get_device_name(), "copy_gb_s": bw,
            "kernels_per_step": sum(count.values()) // 5, "groups": groups,
            "kernels": {n: ms for n, ms in rows},
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
