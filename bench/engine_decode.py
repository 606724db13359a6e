"""Decode step time of the whole engine against the HBM floor, and GPU busy fraction in steady
decode with 1 vs 2 batches in flight; prints a table, writes JSON rows with --json PATH.

    python bench/engine_decode.py [--json PATH]                 # H100: llama3-8b, llama3.2-1b
    python bench/engine_decode.py --device cpu --cases tiny:1,4 # checks the script runs
    python bench/engine_decode.py --tp 2 --cases llama3-8b:1,64    # tensor parallel, 2 GPUs
    python bench/engine_decode.py --tp 2 --allreduce oneshot ...    # the one-shot all-reduce
    python bench/engine_decode.py --tp 2 --allreduce fused --depths 2 ...  # fused with the norm

Each case serves `batch` requests of CONTEXT prompt tokens and DECODE output tokens through
`engine.Engine` (random weights, bf16, CUDA graphs on, asap arrivals) and reads the engine's own
hooks: per step a GPU interval from CUDA events on the compute stream.
- step_ms: median GPU interval of the steady pure-decode steps (all `batch` requests decoding,
  first WARMUP and last 2 dropped): input copies + graph replay + sampler.
- wall_ms: wall time per steady step (first to last GPU start / steps).
- floor_ms = (weight bytes a forward reads + KV bytes read) / tp / copy bandwidth: one GPU's HBM
  floor (`--tp` N, config key tensor_parallel_size: each rank reads 1/N of the weights and of
  the KV heads; all-reduces are not in the floor), where the KV read is the steps' mean
  kv_read_tokens x bytes per token and the bandwidth comes from a large device-to-device copy
  on GPU 0 in the same run (read + write bytes / time).
- busy_fraction: GPU busy time / wall time over the steady steps (1.0 = no bubbles).
- broadcast_us: median host time of rank 0's step broadcast (tensor parallelism, else 0);
  broadcast_parts_us: its medians in parts [new slots' payload built and the step's host
  arrays checked against the ring slot, header, payload and host input arrays written to the
  shared-memory ring, device broadcasts enqueued (0 unless the arrays did not fit a slot)];
  broadcast_ring_steps: how many of the steady steps sent their inputs through the ring.
With --json the file is rewritten after every case (a later case that hangs or fails leaves
the earlier rows written), and a case that fails is one row with its error.
The KV cache is sized for the cases (config num_kv_blocks), not from free memory, so the run
stays short; everything else is the engine as replay runs it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bubblesim.core.atomic import atomic_file  # noqa: E402
from bubblesim.core.config import Config  # noqa: E402
from bubblesim.core.models import get_model  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.requests import RequestInput  # noqa: E402

CONTEXT = 512
DECODE = 72
WARMUP = 8
BLOCK_SIZE = 16
CASES = "llama3-8b:1,8,64;llama3.2-1b:1,64"


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes per second of a large device-to-device copy, counting read + write."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


def make_engine(
    model: str,
    max_batch: int,
    depth: int,
    device: str,
    max_model_len: int = 2048,
    context: int = CONTEXT,
    tp: int = 1,
    allreduce: str = "nccl",
) -> Engine:
    per_req = -(-(context + DECODE + 1) // BLOCK_SIZE)
    cfg = Config(
        model=model,
        device=device,
        dtype="bfloat16",
        max_num_seqs=max_batch,
        max_num_batched_tokens=8192,
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        num_kv_blocks=max_batch * per_req + 64,
        cuda_graphs=True,
        gc_freeze=True,
        batches_in_flight=depth,
        arrival="asap",
        tensor_parallel_size=tp,
        tp_allreduce=allreduce,
    )
    eng = Engine(cfg)
    if tp > 1:
        eng.broadcast_parts = []  # rank 0's broadcast in parts, per step
        eng.broadcast_ring = []  # and whether its inputs rode in the ring
    return eng


def measure(eng: Engine, batch: int, bandwidth: float, context: int = CONTEXT) -> dict:
    reqs = [RequestInput(f"b{i}", context, DECODE) for i in range(batch)]
    if eng.broadcast_parts is not None:
        eng.broadcast_parts.clear()  # this run's steps only, as its trace
    if eng.broadcast_ring is not None:
        eng.broadcast_ring.clear()
    eng.run(reqs)
    tr = eng.trace
    rows = [i for i, s in enumerate(tr.shapes) if s.is_pure_decode and s.num_reqs == batch]
    rows = rows[WARMUP:-2]
    if len(rows) < 8:
        raise RuntimeError(f"only {len(rows)} steady decode steps")
    lo, hi = rows[0], rows[-1] + 1
    assert rows == list(range(lo, hi)), "steady decode steps are consecutive"
    g = tr.gpu_ns[lo:hi]
    step_ms = float(np.median(g[:, 1] - g[:, 0])) / 1e6
    wall_ms = (g[-1, 0] - g[0, 0]) / (len(g) - 1) / 1e6
    spec, dtype = eng.spec, eng.cfg.dtype
    kv_tokens = float(np.mean([tr.shapes[i].kv_read_tokens for i in rows]))
    tp = eng.cfg.tensor_parallel_size
    read_bytes = spec.decode_weight_bytes(dtype) + kv_tokens * spec.kv_bytes_per_token(dtype)
    floor_ms = read_bytes / tp / bandwidth * 1e3  # one GPU's share
    return {
        "model": spec.name,
        "batch": batch,
        "batches_in_flight": eng.depth,
        "tensor_parallel_size": tp,
        "tp_allreduce": eng.cfg.tp_allreduce if tp > 1 else "",
        "step_ms": round(step_ms, 4),
        "wall_ms": round(float(wall_ms), 4),
        "floor_ms": round(floor_ms, 4),
        "ratio": round(step_ms / floor_ms, 3),
        "busy_fraction": round(tr.gpu_busy_fraction(lo, hi), 4),
        # tensor parallelism: rank 0's host time sending each step to the other ranks
        "broadcast_us": round(float(np.median(np.diff(tr.broadcast_ns[lo:hi], axis=1))) / 1e3, 1)
        if tp > 1
        else 0.0,
        "broadcast_parts_us": broadcast_parts_us(eng, lo, hi),
        "broadcast_ring_steps": ring_steps(eng, lo, hi),
        "steps": len(rows),
        "kv_read_tokens": round(kv_tokens),
        "copy_gbps": round(bandwidth / 1e9, 1),
        "gpu": torch.cuda.get_device_name() if eng.device.type == "cuda" else "cpu",
    }


def ring_steps(eng: Engine, lo: int, hi: int) -> int | None:
    """Steps lo..hi whose host input arrays rode in the ring (Engine.broadcast_ring: 1 per
    broadcast step, 0 when they went by the device broadcast)."""
    flags = eng.broadcast_ring
    return None if flags is None or len(flags) < hi else int(sum(flags[lo:hi]))


def broadcast_parts_us(eng: Engine, lo: int, hi: int) -> list[float] | None:
    """Medians over steps lo..hi of rank 0's broadcast parts (Engine.broadcast_parts: one entry
    per broadcast step; every step of a tensor-parallel run broadcasts), in microseconds."""
    parts = eng.broadcast_parts
    if not parts or len(parts) < hi:
        return None
    arr = np.asarray(parts[lo:hi], dtype=np.float64)
    return [round(float(x) / 1e3, 1) for x in np.median(arr, axis=0)]


def profile_steps(eng: Engine, batch: int, path: Path, context: int = CONTEXT) -> None:
    """Kernel table of one more run of the case under torch.profiler (GPU time per kernel name,
    summed over the run, and per decode step), written to `path`."""
    reqs = [RequestInput(f"p{i}", context, DECODE) for i in range(batch)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.run(reqs)
    steps = sum(1 for s in eng.trace.shapes if s.is_pure_decode)
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    total_us = sum(e.device_time_total for e in rows)
    lines = [f"{steps} pure-decode steps of {len(eng.trace.shapes)}; GPU us total {total_us:.0f}"]
    lines.append(f"{'us/step':>9} {'calls/step':>10}  name")
    for e in rows:
        lines.append(f"{e.device_time_total / steps:9.2f} {e.count / steps:10.2f}  {e.key[:110]}")
    path.write_text("\n".join(lines) + "\n")


def free_engine(eng: Engine | None) -> None:
    if eng is not None:
        eng.close()  # tensor parallelism: its worker ranks stop
    del eng
    gc.unfreeze()  # the engine froze its start-up objects; let them go
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def save(path: Path | None, results: list[dict]) -> None:
    """Every row so far, atomically (after each case: a later hang keeps them)."""
    if path is not None:
        atomic_file(path, json.dumps(results, indent=1))


def parse_cases(text: str) -> list[tuple[str, list[int]]]:
    out = []
    for part in text.split(";"):
        model, _, batches = part.partition(":")
        get_model(model)  # a bad name fails here, before any GPU work
        out.append((model, [int(b) for b in batches.split(",")]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=CASES, help="model:b1,b2;model:b1 (default %(default)s)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=CONTEXT, help="prompt tokens per request")
    ap.add_argument(
        "--max-model-len", type=int, default=2048, help="the engine's max_model_len (graphs' bound)"
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (GPUs per engine)")
    ap.add_argument(
        "--allreduce", default="nccl", help="tp_allreduce: nccl | oneshot | fused (--tp > 1)"
    )
    ap.add_argument(
        "--depths",
        default="1,2",
        help="batches_in_flight values, one engine each (oneshot and "
        "fused: one per process, engine.tp.comm.check_symmetric)",
    )
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument(
        "--profile", type=Path, help="folder: a torch.profiler kernel table per case (batch <= 8)"
    )
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --cases tiny:1,4 to check the script")
        return 2
    device = torch.device(args.device)
    cases = parse_cases(args.cases)
    t_start = time.perf_counter()
    bandwidth = copy_bandwidth(device)
    if device.type != "cuda":
        bandwidth = 20e9  # a nominal figure: CPU runs only check the script
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
    results, failed = [], []
    for model, batches in cases:
        for depth in (int(d) for d in args.depths.split(",")):
            eng = None
            try:
                t0 = time.perf_counter()
                eng = make_engine(
                    model, max(batches), depth, args.device, args.max_model_len, args.context,
                    args.tp, args.allreduce,
                )  # fmt: skip
                print(f"{model} depth {depth}: engine ready in {time.perf_counter() - t0:.1f} s")
                for batch in batches:
                    row = measure(eng, batch, bandwidth, args.context)
                    results.append(row)
                    save(args.json, results)
                    print(
                        f"  batch {batch:3d}: step {row['step_ms']:.3f} ms, floor "
                        f"{row['floor_ms']:.3f} ms, busy {row['busy_fraction']:.3f}, "
                        f"broadcast {row['broadcast_us']:.1f} us "
                        f"(parts {row['broadcast_parts_us']}, "
                        f"ring {row['broadcast_ring_steps']}/{row['steps']} steps)",
                        flush=True,
                    )
                    if args.profile and batch <= 8 and device.type == "cuda":
                        args.profile.mkdir(parents=True, exist_ok=True)
                        name = f"{model}-b{batch}-d{depth}.txt"
                        profile_steps(eng, batch, args.profile / name, args.context)
            except Exception as e:  # keep going: the other cases still tell something
                traceback.print_exc()
                failed.append(f"{model} depth {depth}: {type(e).__name__}: {e}")
                results.append({"model": model, "batches_in_flight": depth, "error": failed[-1]})
                save(args.json, results)
            finally:
                t0 = time.perf_counter()
                free_engine(eng)
                if args.tp > 1:
                    print(f"{model} depth {depth}: engine closed in "
                          f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
    print()
    head = f"{'model':<14}{'tp':>3}{'allreduce':>10}{'batch':>6}{'depth':>6}"
    head += f"{'step_ms':>10}{'wall_ms':>10}"
    head += f"{'floor_ms':>10}{'ratio':>8}{'busy':>8}"
    print(head)
    for r in results:
        if "error" in r:
            continue
        print(
            f"{r['model']:<14}{r['tensor_parallel_size']:>3}{r['tp_allreduce']:>10}{r['batch']:>6}"
            f"{r['batches_in_flight']:>6}{r['step_ms']:>10.3f}"
            f"{r['wall_ms']:>10.3f}{r['floor_ms']:>10.3f}{r['ratio']:>8.2f}"
            f"{r['busy_fraction']:>8.3f}"
        )
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    for f in failed:
        print("FAILED:", f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
