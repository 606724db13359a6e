"""The fused all-reduce's measured decode-step change beside the simulator's what-if.

    python reports/tp/fused_whatif.py NCCL_JSON FUSED_JSON [--profile P] [--set k=v ...]

NCCL_JSON, FUSED_JSON: `bench/engine_decode.py --json` rows of the same host (one model and
degree, tp_allreduce nccl and fused). For each (batch, depth) in both, prints the measured
step ms of each algorithm and the change, beside the simulator's GPU pass of the same decode
shape (batch rows decoding, the row's kv_read_tokens read) under each algorithm: with
`--profile` its fitted decode model plus the difference between the two algorithms'
collectives (sim.cost.model, the profile's tp_allreduce being nccl), else the roofline and the
collectives' models.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bubblesim.core.config import load_config  # noqa: E402
from bubblesim.core.shape import BatchShape  # noqa: E402
from sim.cost.model import load_cost_model  # noqa: E402


def rows_by_case(path: Path) -> dict[tuple[int, int], dict]:
    return {
        (r["batch"], r["batches_in_flight"]): r
        for r in json.loads(path.read_text())
        if "error" not in r
    }


def decode_shape(batch: int, kv_read_tokens: int) -> BatchShape:
    longest = -(-kv_read_tokens // batch)
    return BatchShape(
        num_reqs=batch, decode_tokens=batch, kv_read_tokens=kv_read_tokens,
        attn_pairs=kv_read_tokens, max_kv_tokens=longest, context_tokens=kv_read_tokens,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("nccl", type=Path)
    ap.add_argument("fused", type=Path)
    ap.add_argument("--profile", help="a calibrated profile of the model and degree")
    ap.add_argument("--set", action="append", default=[], help="more config keys (k=v)")
    args = ap.parse_args()
    nccl, fused = rows_by_case(args.nccl), rows_by_case(args.fused)
    first = next(iter(nccl.values()))
    base = [
        f"model={first['model']}",
        "gpu=h100",
        f"tensor_parallel_size={first['tensor_parallel_size']}",
        *([f"profile={args.profile}"] if args.profile else []),
        *args.set,
    ]
    models = {
        a: load_cost_model(load_config(None, [*base, f"tp_allreduce={a}"]))
        for a in ("nccl", "fused")
    }
    print(f"{'batch':>5} {'depth':>5} | {'measured ms: nccl':>17} {'fused':>7} {'change':>7} | "
          f"{'predicted: nccl':>15} {'fused':>7} {'change':>7}")  # fmt: skip
    for case in sorted(set(nccl) & set(fused)):
        m_n, m_f = nccl[case]["step_ms"], fused[case]["step_ms"]
        shape = decode_shape(case[0], int(nccl[case]["kv_read_tokens"]))
        p_n, p_f = (models[a].gpu_pass_ms(shape) for a in ("nccl", "fused"))
        print(
            f"{case[0]:>5} {case[1]:>5} | {m_n:>17.3f} {m_f:>7.3f} {m_f - m_n:>+7.3f} | "
            f"{p_n:>15.3f} {p_f:>7.3f} {p_f - p_n:>+7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
