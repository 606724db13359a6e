"""Host launch time and GPU time of the speculative-decoding parts that the seed switches change,
on their own; prints a table and (--profile) writes them as simulator cost terms.

    python bench/spec_parts.py [--json PATH] [--profile PATH] [--quick]

Per part and batch size B (k = 3): `cpu_us` = host time per call with the GPU running behind
(launches and host work, what a CPU phase pays), `gpu_us` = device time per call from a CUDA
graph of it (kernels alone, no launch gaps). Parts:
- finish: engine.spec.slot_mapping.finish_inputs, fix 0 and 1 (seed 5 off/on launch the same
  kernel; `fix` adds the correction), and its torch version for scale;
- ngram: NgramProposerGPU append + propose over a W-token window (seed 4 after);
- count: accepted counts by cat + argmax vs by sum (seed 2);
- backup: backup token ids by list + np.array vs into the preallocated buffer (seed 1; host
  work and one copy);
- known: the host part of seed 5 on (the in-flight rejections list per step).
`--profile PATH` writes these as a partial cost profile (`terms` in ms, linear in num_reqs
where the part scales with B): the base profile `replay ablate --calibrate-on` uses for the
terms one side of a switch cannot show (reports/ablate/predict.sh). CPU only checks it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.spec.backup_tokens import BackupTokenIds  # noqa: E402
from engine.spec.ngram_gpu import NgramProposerGPU  # noqa: E402
from engine.spec.slot_mapping import finish_inputs  # noqa: E402
from engine.spec.verify import count_valid_cat_argmax, count_valid_sum  # noqa: E402

K, BLOCK_SIZE, SLOTS, MAX_LEN = 3, 16, 256, 8192
BATCHES, QUICK = (1, 8, 64, 256), (1, 64)
WINDOWS = (1024, 4096)


def cpu_us(fn: Callable[[], object], dev: torch.device, iters: int) -> float:
    """Host time per call, the GPU running behind (synchronised only around the loop)."""
    for _ in range(3):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return t * 1e6 / iters


def gpu_us(fn: Callable[[], object], dev: torch.device, iters: int) -> float | None:
    """Device time per call: a CUDA graph of `fn` replayed (no launch gaps); None on CPU."""
    if dev.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / iters


def finish_case(b: int, dev: torch.device):
    """A decode step of b rows with k drafts each in the engine's layout, drafts in flight."""
    rng = np.random.default_rng(b)
    q, t = K + 1, b * (K + 1)
    max_blocks = MAX_LEN // BLOCK_SIZE
    rows = np.zeros((13, SLOTS * q + 1), np.int32)  # engine.spec.inputs: 9 + 4 fields
    rows[0, : b + 1] = np.arange(0, t + 1, q)
    slots = rng.permutation(SLOTS)[:b]
    start = rng.integers(100, 4000, b)
    rows[1, :b], rows[2, :b], rows[9, :b] = start + q, slots, 0
    pos = (start[:, None] + np.arange(q)[None, :]).ravel()
    table = rng.permutation(SLOTS * max_blocks).reshape(SLOTS, max_blocks).astype(np.int32)
    smap = table[np.repeat(slots, q), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    raw = -1 - np.repeat(slots, q)
    toks = np.concatenate([raw, pos, smap, pos - 50, pos * 0 - 1]).astype(np.int32)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    args = dict(
        rows=i32(rows),
        fields=(0, 1, 2, 9),
        toks=i32(toks),
        t=t,
        num_rows=b,
        token_source=i32(rng.integers(0, 500, SLOTS * (1 + K))),
        resolved=torch.zeros(t, dtype=torch.int32, device=dev),
        input_ids=torch.zeros(t, dtype=torch.int32, device=dev),
        rejected_total=torch.zeros(SLOTS, dtype=torch.int32, device=dev),
        block_table=i32(table),
        block_size=BLOCK_SIZE,
    )
    return args


def bench(dev: torch.device, batches: tuple[int, ...], iters: int) -> list[dict]:
    rows: list[dict] = []

    def add(part: str, variant: str, b: int, fn: Callable[[], object], **extra) -> None:
        rows.append(
            dict(part=part, variant=variant, num_reqs=b, cpu_us=cpu_us(fn, dev, iters),
                 gpu_us=gpu_us(fn, dev, iters), **extra)
        )  # fmt: skip

    triton_ok = dev.type == "cuda"
    for b in batches:
        args = finish_case(b, dev)
        for fix in (0, 1):
            if triton_ok:
                add("finish", f"kernel fix={fix}", b, lambda a=args, f=fix: finish_inputs(
                    **a, fix=bool(f), triton_kernel=True))  # fmt: skip
            add("finish", f"torch fix={fix}", b, lambda a=args, f=fix: finish_inputs(
                **a, fix=bool(f), triton_kernel=False))  # fmt: skip
    prop = NgramProposerGPU(SLOTS, MAX_LEN, K, 2, 4, dev)
    text = np.tile(np.random.default_rng(0).integers(0, 500, 97), MAX_LEN // 97 + 1)
    for s in range(SLOTS):
        prop.reset_slot(s, text[: MAX_LEN // 2])
    table = torch.zeros((SLOTS, K), dtype=torch.int32, device=dev)  # SpecDecoder.draft_table
    for b in batches:
        slots = torch.arange(b, device=dev)
        ids = torch.full((b, K + 1), -1, dtype=torch.int32, device=dev)  # appends nothing
        for w in WINDOWS:
            prop.num_tokens[:b] = w - 8

            def draft(s=slots, i=ids, w=w):  # SpecDecoder.draft_gpu's device work
                prop.append(s, i)
                table[s] = prop.propose(s, max_len=w)

            add("ngram", f"append+propose W={w}", b, draft, window=w)
        verified = torch.randint(-1, 5, (b, K + 1), dtype=torch.int32, device=dev)
        out = torch.zeros(b, dtype=torch.int64, device=dev)
        add("count", "cat+argmax", b, lambda v=verified, o=out: o.copy_(count_valid_cat_argmax(v)))
        add("count", "sum", b, lambda v=verified, o=out: count_valid_sum(v, o))
        tokens = [np.arange(600, dtype=np.int32) for _ in range(b)]
        nts = np.full(SLOTS, 500, np.int64)
        for pre in (False, True):
            buf = BackupTokenIds(1, SLOTS, dev, preallocated=pre)
            name = "prealloc" if pre else "list"

            def backup(x=buf, t=tokens, n=nts, b=b):
                return x.prepare(0, t, n, b)

            rows.append(dict(part="backup", variant=name, num_reqs=b, gpu_us=None,
                             cpu_us=cpu_us(backup, dev, iters)))  # fmt: skip
        known = np.zeros(SLOTS, np.int64)
        slot_of = list(range(b))

        def known_rows(known=known, slot_of=slot_of):  # spec fill's extra work, seed 5 on
            of = known.tolist()
            return [of[s] for s in slot_of]

        rows.append(dict(part="known", variant="host list", num_reqs=b, gpu_us=None,
                         cpu_us=cpu_us(known_rows, dev, iters)))  # fmt: skip
    return rows


def _line(rows: list[dict], part: str, variant: str, key: str) -> dict[str, float]:
    """A linear model in num_reqs (ms) through the part's points: least squares, >= 0."""
    pts = [(r["num_reqs"], r[key]) for r in rows if r["part"] == part and r["variant"] == variant]
    pts = [(b, v) for b, v in pts if v is not None]
    if not pts:
        return {}
    x = np.array([b for b, _ in pts], float)
    y = np.array([v for _, v in pts], float) * 1e-3
    if len(set(x.tolist())) < 2:
        return {"intercept": float(y.mean())}
    slope, icpt = np.polyfit(x, y, 1)
    if slope < 0 or icpt < 0:
        return {"intercept": float(y.mean())}
    return {"intercept": float(icpt), "num_reqs": float(slope)}


def _diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """a - b term by term, floored at 0 (a term is a cost)."""
    return {k: max(0.0, a.get(k, 0.0) - b.get(k, 0.0)) for k in sorted({*a, *b})}


def terms_profile(rows: list[dict], device_name: str) -> dict:
    """The measured parts as simulator terms (sim/cost/terms.py): what this engine pays for
    each side of seeds 1, 2, 4 (after) and 5."""
    w = max(WINDOWS)
    ngram = [r for r in rows if r["part"] == "ngram" and r.get("window") == w]
    ngram_cpu = _line(ngram, "ngram", f"append+propose W={w}", "cpu_us")
    fix_cpu = _diff(_line(rows, "finish", "kernel fix=1", "cpu_us"),
                    _line(rows, "finish", "kernel fix=0", "cpu_us"))  # fmt: skip
    known = _line(rows, "known", "host list", "cpu_us")
    fix_gpu = _diff(_line(rows, "finish", "kernel fix=1", "gpu_us"),
                    _line(rows, "finish", "kernel fix=0", "gpu_us"))  # fmt: skip
    terms = {
        "draft.ngram_gpu_launch": ngram_cpu,
        "prepare_inputs.optimistic_fix": {
            k: fix_cpu.get(k, 0) + known.get(k, 0) for k in sorted({*fix_cpu, *known})
        },  # fmt: skip
        "gpu.optimistic_fix": fix_gpu,
        "sample.accept_count_cat": _line(rows, "count", "cat+argmax", "cpu_us"),
        "sample.accept_count_sum": _line(rows, "count", "sum", "cpu_us"),
        "gpu.accept_count_cat": _line(rows, "count", "cat+argmax", "gpu_us"),
        "gpu.accept_count_sum": _line(rows, "count", "sum", "gpu_us"),
        "draft.backup_tokens_list": _line(rows, "backup", "list", "cpu_us"),
        "draft.backup_tokens_prealloc": _line(rows, "backup", "prealloc", "cpu_us"),
    }
    return {
        "version": 1,
        "notes": f"engine spec parts measured by bench/spec_parts.py on '{device_name}' "
        f"(host launch time for CPU terms, CUDA-graph device time for gpu.*); k={K}",
        "terms": {n: {k: round(v, 9) for k, v in m.items()} for n, m in terms.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="B = 1 and 64 only, fewer iterations")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--profile", type=Path, help="write the measured terms as a cost profile")
    args = ap.parse_args()
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rows = bench(dev, QUICK if args.quick else BATCHES, 50 if args.quick else 300)
    print(f"{'part':<8} {'variant':<26} {'B':>4} {'cpu_us':>8} {'gpu_us':>8}   ({name})")
    for r in rows:
        g = "-" if r["gpu_us"] is None else f"{r['gpu_us']:.1f}"
        print(f"{r['part']:<8} {r['variant']:<26} {r['num_reqs']:>4} {r['cpu_us']:>8.1f} {g:>8}")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=1) + "\n")
    if args.profile:
        prof = terms_profile(rows, name)
        args.profile.write_text(json.dumps(prof, indent=2) + "\n")
        print(f"terms -> {args.profile}")


if __name__ == "__main__":
    main()
