"""The simulator's decode-pass cost per call, as the step loop calls it and as the fast path
calls it (its form specialised for the batch size: `keyed`, sim.stepcosts), per committed profile.

    python bench/decode_cost.py [--calls 100000] [--json PATH]

Each case times `CostModel.gpu_decode_ms_fn()` on one decode shape (40 requests, ~900 context
tokens each) and its `keyed(shape, KEY_FIELDS)` form, and checks the two give the same float on
2,000 random shapes of the same batch size. A timing on a shared machine moves run to run; the
ratio is what to read.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bubblesim.core.config import load_config  # noqa: E402
from sim.cost import CostModel  # noqa: E402
from sim.cost.profile import load_profile  # noqa: E402
from sim.stepcosts import KEY_FIELDS, StepShape  # noqa: E402

G = "reports/fidelity/gen"
CASES: dict[str, list[str]] = {  # name -> config
    "h100-8b": ["model=llama3-8b", f"profile={G}/profile-h100-llama3-8b.json"],
    "h200-1b": ["model=llama3.2-1b", "gpu=h200", f"profile={G}/profile-h200-llama3.2-1b.json"],
    "h100-1b-spec": ["model=llama3.2-1b", f"profile={G}/profile-h100-llama3.2-1b.json",
                     "spec.method=ngram-gpu", "spec.k=3"],
    "h200-8b-top_p": ["model=llama3-8b", "gpu=h200", f"profile={G}/profile-h200-llama3-8b.json",
                      "sampling.temperature=0.8", "sampling.top_p=0.9"],
    "roofline-8b": ["model=llama3-8b"],
}  # fmt: skip


def _shape(cfg: Any, b: int) -> StepShape:
    s = StepShape()
    if cfg.spec.enabled:
        s.set_verify(b, b * (1 + cfg.spec.k), b * cfg.spec.k)
    else:
        s.set_decode(b)
    s.kv_read_tokens = s.attn_pairs = s.context_tokens = b * 900
    s.max_kv_tokens = 2000
    return s


def case(sets: list[str], calls: int) -> dict[str, Any]:
    cfg = load_config(None, sets)
    cost = CostModel(cfg, load_profile(cfg.profile) if cfg.profile else None)
    fn = cost.gpu_decode_ms_fn()
    s = _shape(cfg, 40)
    keyed = getattr(fn, "keyed", None)
    spec = keyed(s, KEY_FIELDS) if keyed is not None else fn
    rng = random.Random(0)
    same = True
    for _ in range(2000):
        mx = rng.randint(1, 130_000)
        s.max_kv_tokens = mx
        s.kv_read_tokens = s.attn_pairs = s.context_tokens = rng.randint(40, 40 * mx)
        s.history_tokens = rng.choice((0, 0, 1000))
        same = same and fn(s) == spec(s)
    s = _shape(cfg, 40)
    full = timeit.timeit(lambda: fn(s), number=calls) / calls * 1e6
    fast = timeit.timeit(lambda: spec(s), number=calls) / calls * 1e6
    return {"us_per_call": full, "keyed_us_per_call": fast, "same_floats": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = {name: case(sets, args.calls) for name, sets in CASES.items()}
    print(f"{'case':<16} {'us/call':>8} {'keyed':>8} {'ratio':>6}  same floats")
    for name, r in rows.items():
        ratio = r["keyed_us_per_call"] / r["us_per_call"]
        print(f"{name:<16} {r['us_per_call']:>8.2f} {r['keyed_us_per_call']:>8.2f} {ratio:>6.2f}"
              f"  {r['same_floats']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
