"""The decode attention kernel's compiled resources and how many of its programs an SM holds at
once (GPU only): the slots of reports/fidelity/wave_tail.py's list-scheduling model.

    python bench/decode_occupancy.py [--json PATH]

Per model (its head counts and head_dim), the kernel is compiled as the engine's decode graphs
run it (rotary embedding and the new token's KV write in the kernel: ROPE and WRITE_KV) and
plain (the cache holds every key). From each compiled kernel's registers a thread, shared
memory and warps: blocks per SM as each limit allows (registers allocated per warp in units of
256, the SM's thread and shared-memory limits, 32 blocks), and the slots (x SMs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bubblesim.core.models import get_model  # noqa: E402
from engine.kernels.decode_attention import compiled_kernels, decode_attention  # noqa: E402

MODELS = ("llama3-8b", "llama3.2-1b")
REG_UNIT = 256  # registers are allocated to a warp in units of this many
MAX_BLOCKS_PER_SM = 32


def blocks_per_sm(regs: int, shared: int, warps: int, props: Any) -> dict[str, int]:
    """Blocks an SM holds, per limit, and the least of them."""
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    limits = {
        "registers": props.regs_per_multiprocessor // (per_warp * warps) if regs else 99,
        "threads": props.max_threads_per_multi_processor // (32 * warps),
        "shared": props.shared_memory_per_multiprocessor // shared if shared else 99,
        "blocks": MAX_BLOCKS_PER_SM,
    }
    limits["blocks_per_sm"] = min(limits.values())
    return limits


def measure(model_name: str) -> list[dict[str, Any]]:
    m = get_model(model_name)
    hq, hkv, d = m.num_heads, m.num_kv_heads, m.head_dim
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    b, bs, ctx = 64, 16, 1000
    blocks = b * (ctx // bs + 2)
    kc = torch.randn(blocks, bs, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    knew = torch.randn(b, hkv, d, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    seq = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    tables = torch.arange(blocks, dtype=torch.int32, device=dev).view(b, -1)
    cos = torch.randn(ctx + 16, d // 2, device=dev, dtype=torch.float32)
    slots = (tables[:, ctx // bs].long() * bs + ctx % bs).contiguous()
    kw_graph = {"cos": cos, "sin": cos.clone(), "slot_mapping": slots}
    rows = []
    for variant, kw in (("graphs (ROPE, WRITE_KV)", kw_graph), ("plain", {})):
        before = set(compiled_kernels())
        decode_attention(q, knew, knew.clone(), kc, vc, qsl, seq, tables, m.max_context,
                         d**-0.5, **kw)  # fmt: skip
        torch.cuda.synchronize()
        for key, k in compiled_kernels().items():
            if key in before:
                continue
            md = k.metadata
            lim = blocks_per_sm(k.n_regs, md.shared, md.num_warps, props)
            rows.append({
                "model": model_name, "variant": variant, "head_dim": d, "regs": k.n_regs,
                "spills": k.n_spills, "shared_bytes": md.shared, "warps": md.num_warps, **lim,
                "sms": props.multi_processor_count,
                "slots": lim["blocks_per_sm"] * props.multi_processor_count,
            })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_occupancy needs a CUDA GPU")
    rows = [r for name in MODELS for r in measure(name)]
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    head = f"{'model':12s} {'variant':24s} {'hd':>3s} {'regs':>4s} {'smem B':>7s} {'warps':>5s} "
    print(head + f"{'by regs':>7s} {'threads':>7s} {'smem':>5s} {'blocks/SM':>9s} {'slots':>5s}")
    for r in rows:
        print(f"{r['model']:12s} {r['variant']:24s} {r['head_dim']:3d} {r['regs']:4d} "
              f"{r['shared_bytes']:7d} {r['warps']:5d} {r['registers']:7d} {r['threads']:7d} "
              f"{r['shared']:5d} {r['blocks_per_sm']:9d} {r['slots']:5d}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
