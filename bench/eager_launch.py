"""Host time to issue one eager (not graph-captured) forward: where the launch phase of a
prefill or mixed step goes; print a table and the top host functions.

    python bench/eager_launch.py [--model llama3.2-1b] [--iters 30] [--json PATH]

Each timing issues `model.forward` + `compute_logits` for a mixed batch while the GPU is kept
busy by a spin kernel enqueued first, so the host never waits for the device (the time is
issue cost alone, as in a replay step whose GPU is still running the previous batch). One extra
call per shape runs under cProfile; the table lists the functions with the most own time.
`--idle 50:sleep,50:spin` also times every case after a pause before each issue: the host
asleep (as the engine between arrivals) or spinning (host busy, GPU idle), to tell a host that
slows after idling (clocks, caches) from anything the GPU does.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.mixed_attention import mixed_metadata  # noqa: E402
from bubblesim.core.models import get_model  # noqa: E402
from engine.model import LlamaModel, allocate_kv_cache  # noqa: E402

# (decodes, context, long, long_context, chunk, chunk_context), as bench/mixed_attention.py
CASES = [(0, 0, 0, 0, 512, 0), (0, 0, 0, 0, 2048, 0), (32, 1000, 0, 0, 512, 0)]
SPIN_CYCLES = 2_000_000_000  # ~1 s at ~2 GHz: longer than any issue below


def issue_ms(model, ids, pos, attn, cache, num_gen: int, cuda: bool) -> float:
    gen_rows = attn.query_start_loc[1 : num_gen + 1] - 1
    t0 = time.perf_counter()
    hidden = model(ids, pos, attn, cache)
    model.compute_logits(hidden[gen_rows])
    return (time.perf_counter() - t0) * 1e3


def pause(ms: float, how: str) -> None:
    """Before an issue: nothing, the host asleep (`sleep`: the thread idles, as the engine does
    between arrivals) or spinning on the clock (`spin`: the host busy, the GPU idle)."""
    if ms <= 0 or how == "none":
        return
    if how == "sleep":
        time.sleep(ms / 1e3)
        return
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def bench_case(model, spec, case, device, iters: int, top: int, idle=(0.0, "none")) -> dict:
    cuda = device.type == "cuda"
    attn, num_blocks = mixed_metadata(case, device)
    cache = allocate_kv_cache(spec, num_blocks, 16, model.dtype, device)
    t = int(attn.query_start_loc[-1])
    ids = torch.zeros(t, dtype=torch.int32, device=device)
    pos = torch.zeros(t, dtype=torch.int32, device=device)
    num_gen = attn.num_seqs
    times = []
    with torch.no_grad():
        for i in range(iters + 1):
            pause(*idle)
            if cuda:
                torch.cuda._sleep(SPIN_CYCLES // 10)
            ms = issue_ms(model, ids, pos, attn, cache, num_gen, cuda)
            if cuda:
                torch.cuda.synchronize()
            if i:  # the first call may compile or load kernels
                times.append(ms)
        prof = cProfile.Profile()
        if cuda:
            torch.cuda._sleep(SPIN_CYCLES // 10)
        prof.enable()
        issue_ms(model, ids, pos, attn, cache, num_gen, cuda)
        prof.disable()
        if cuda:
            torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    funcs = [
        {"func": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "calls": v[1], "own_ms": round(v[2] * 1e3, 3),
         "cum_ms": round(v[3] * 1e3, 3)}
        for k, v in rows
    ]  # fmt: skip
    decodes, _, long, _, chunk, _ = case
    return {
        "tokens": t, "decodes": decodes + long, "chunk": chunk, "idle_ms": idle[0],
        "idle": idle[1],
        "issue_ms_median": round(statistics.median(times), 3),
        "issue_ms_min": round(min(times), 3), "issue_ms_max": round(max(times), 3),
        "top": funcs,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", metavar="PATH")
    p.add_argument(
        "--idle",
        default="",
        metavar="MS:HOW,...",
        help="also time each case after a pause before every issue, e.g. "
        "2:sleep,50:sleep,50:spin (sleep: host thread idle; spin: host busy)",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    spec = get_model(args.model)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = LlamaModel(spec, dtype, device, max_positions=8192).init_random(0)
    cases = CASES if cuda else [(2, 20, 0, 0, 8, 0)]
    idles = [(0.0, "none")] + [
        (float(x.split(":")[0]), x.split(":")[1]) for x in args.idle.split(",") if x
    ]
    n = args.iters if cuda else 2
    rows = [bench_case(model, spec, c, device, n, args.top, i) for c in cases for i in idles]
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"model {spec.name}, {gpu}: host ms to issue one eager forward + logits")
    for r in rows:
        print(f"tokens {r['tokens']:5d} decodes {r['decodes']:3d} chunk {r['chunk']:5d} "
              f"after {r['idle_ms']:g} ms {r['idle']}: "
              f"median {r['issue_ms_median']:.3f} ms (min {r['issue_ms_min']:.3f}, "
              f"max {r['issue_ms_max']:.3f})")  # fmt: skip
        for f in r["top"]:
            print(f"    {f['own_ms']:8.3f} ms own {f['cum_ms']:8.3f} cum {f['calls']:5d}x "
                  f"{f['func']}")  # fmt: skip
    if args.json:
        doc = {"model": spec.name, "device": gpu, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
