"""`python -m sim.cost [--config F] [--set k=v ...]`: print the cost model's numbers for a few
decode and prefill batches, to eyeball defaults or a calibrated profile."""

from __future__ import annotations

import argparse

from bubblesim.core.cli import add_config_args, config_from_args, run_main
from bubblesim.core.phases import CPU_PHASES, LAUNCH
from bubblesim.core.shape import BatchShape

from .model import load_cost_model


def decode_shape(batch: int, context: int, k: int = 0) -> BatchShape:
    """`batch` decode requests of `context` tokens each, verifying `k` drafts each."""
    q = batch * (1 + k)
    return BatchShape(
        num_reqs=batch,
        decode_tokens=q,
        draft_tokens=batch * k,
        kv_read_tokens=batch * context,
        attn_pairs=q * context,
        max_kv_tokens=context,
        context_tokens=batch * context,
    )


def prefill_shape(tokens: int) -> BatchShape:
    """One prompt of `tokens` tokens in one chunk (causal: ~tokens^2/2 attention pairs)."""
    return BatchShape(
        num_reqs=1,
        num_prefill_reqs=1,
        prefill_tokens=tokens,
        context_tokens=tokens,
        attn_pairs=tokens * (tokens + 1) // 2,
        max_kv_tokens=tokens,
        new_reqs=1,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.cost", description=__doc__)
    add_config_args(p, output=False)
    p.add_argument("--context", type=int, default=1024, help="tokens per decode request")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    cm = load_cost_model(cfg)
    k = cfg.spec.k if cfg.spec.enabled else 0
    print(f"{cm.model.name} on {cm.gpu.name} ({cfg.dtype}), profile: {cfg.profile or 'defaults'}")
    print(f"{'batch':>16} {'gpu_ms':>8} " + " ".join(f"{ph[:8]:>8}" for ph in CPU_PHASES))
    rows = [(f"decode {b}x{args.context}", decode_shape(b, args.context, k)) for b in (1, 8, 64)]
    rows += [(f"prefill {n}", prefill_shape(n)) for n in (512, 8192)]
    for label, s in rows:
        cpu = [cm.cpu_phase_ms(ph, s) for ph in CPU_PHASES]
        cpu[CPU_PHASES.index(LAUNCH)] += cm.launch_ms(s, cfg.cuda_graphs)
        cells = " ".join(f"{x:8.3f}" for x in cpu)
        print(f"{label:>16} {cm.gpu_pass_ms(s) + cm.draft_gpu_ms(s):8.3f} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
