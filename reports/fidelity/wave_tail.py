"""The decode tail as the attention kernel's waves: a list-scheduling model, fitted on the
decode(mix) sweeps and put beside the runs' clean decode steps (section J).

    python reports/fidelity/wave_tail.py SWEEP PROFILE [RUN ...] [--blocks-per-sm N]

The engine's decode attention kernel (engine/kernels/decode_attention.py) launches a grid of
(sequence, kv head, split) programs, sequences fastest, then heads, then splits; the GPU hands
each program, in that order, to the first of its `slots` (SMs x the blocks one SM holds at
once) that frees. A program walks its split's keys (whole tiles), plus a fixed cost
(OVERHEAD_KEYS, in keys). The kernel ends when its last program does: the greedy list
schedule's makespan. A batch of mixed contexts pays, over the uniform batch of its mean
context (what the decode table is fitted on), the difference of the two makespans (`excess`,
in keys), where the simulator's decode model pays `tail_keys` (sim.cost.splits: the longest
program past a mean row's) x a coefficient.

The slots are measured, not fitted: the compiled kernel of the engine's decode graphs (its
ROPE and WRITE_KV specialisation, 4 warps) takes 122 registers a thread on llama3-8b (head_dim
128: 4 blocks per SM) and 72 on llama3.2-1b (head_dim 64: 7 blocks per SM), on an H100
(BLOCKS_PER_SM; `--blocks-per-sm` overrides).

Prints
1. the sweep (SWEEP: `replay shapes --families "decode(mix),decode(mix desc)"`, its spread
   points at >= MIN_ROWS rows against their uniform controls): the fitted ms per key of the
   makespan excess (no intercept) and its R^2, beside `tail_keys`' R^2 on the same points;
   and R^2 at other slot counts (the measured one should be the best);
2. per RUN (measured run folders of that model and GPU): each clean queued decode step's
   contexts, in batch order, are rebuilt from the run's records (`row_contexts`); by band of
   rows, measured / predicted with the profile, without its tail term, and with the excess x
   the sweep's ms per key in its place (PROFILE: the committed profile of the model and GPU),
   and the first and last of these over the first RUN's (give the calibration run first: what
   a profile levelled on it would read).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_diagnose import clean_decode_bands  # noqa: E402

from bubblesim.core.graph_buckets import decode_buckets  # noqa: E402
from bubblesim.core.models import get_model  # noqa: E402
from bubblesim.core.runfmt import load_run  # noqa: E402
from replay.analysis.shapes_file import read_sweep  # noqa: E402
from replay.analysis.shapes_grid import MIX_FAMILIES, MIX_SPREADS, mix_contexts  # noqa: E402
from replay.analysis.steps import predicted_gpu_ms, run_config  # noqa: E402
from sim.cost.splits import (  # noqa: E402
    LONG_SPLIT_KEYS,
    MAX_LONG_SPLITS,
    MAX_SPLITS,
    SMALL_TILE_KEYS,
    TARGET_PROGRAMS_PER_SM,
    TILE_KEYS,
    num_sms,
    tail_keys_fn,
)

BLOCKS_PER_SM = {"llama3-8b": 4, "llama3.2-1b": 7}  # measured: the module docstring
OVERHEAD_KEYS = 256  # a program's fixed cost, in keys (the sweep fits are flat in it)
MIN_ROWS = 64  # sweep points at fewer rows run in one wave: no schedule to tell apart
OTHER_SLOTS_PER_SM = (2, 3, 4, 5, 6, 7, 8, 16)


# ---- the kernel's programs and their schedule ---------------------------------------------------
def _pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def split_plan(bucket: int, heads: int, max_seq_len: int, sms: int) -> tuple[int, int, int]:
    """(splits, keys a tile, tiles a split takes at least) for a decode graph of `bucket`
    rows: engine.kernels.decode_attention.decode_num_splits and its `min_tiles`."""
    fill = TARGET_PROGRAMS_PER_SM * sms
    if bucket * heads >= fill:  # only long sequences split
        s = min(math.ceil(max_seq_len / LONG_SPLIT_KEYS), MAX_LONG_SPLITS)
        return _pow2(s), TILE_KEYS, LONG_SPLIT_KEYS // TILE_KEYS
    s = min(math.ceil(fill / (bucket * heads)), MAX_SPLITS)
    tile = SMALL_TILE_KEYS if s >= 16 else TILE_KEYS
    return _pow2(min(s, math.ceil(max_seq_len / tile))), tile, 1


def programs(
    ctx: Sequence[int], bucket: int, heads: int, max_seq_len: int, sms: int, overhead: float
) -> list[float]:
    """Each active program's keys (+ `overhead`), in the grid's order: splits outermost, then
    kv heads, then sequences (the graph's padding rows and a sequence's unused splits return at
    once and are left out)."""
    splits, tile, min_tiles = split_plan(bucket, heads, max_seq_len, sms)
    per = []
    for c in ctx:
        tiles = -(-c // tile)
        take = max(-(-tiles // splits), min_tiles)
        per.append((tiles, take, -(-tiles // take)))
    return [
        overhead + min(take, tiles - z * take) * tile
        for z in range(splits)
        for _ in range(heads)
        for tiles, take, active in per
        if z < active
    ]


def makespan(durations: Sequence[float], slots: int) -> float:
    """When the last of `durations` ends, each started in order on the first of `slots` to free
    (greedy list scheduling from time 0)."""
    if len(durations) <= slots:
        return max(durations, default=0.0)
    free = list(durations[:slots])
    heapq.heapify(free)
    end = max(free)
    for d in durations[slots:]:
        t = heapq.heappop(free) + d
        heapq.heappush(free, t)
        end = max(end, t)
    return end


def excess(
    ctx: Sequence[int], bucket: int, heads: int, max_seq_len: int, sms: int, slots: int,
    overhead: float = OVERHEAD_KEYS,
) -> float:  # fmt: skip
    """The makespan of `ctx` (batch order) past that of as many rows at its mean (rounded up),
    in keys."""
    mean = -(-sum(ctx) // len(ctx))
    mine = programs(ctx, bucket, heads, max_seq_len, sms, overhead)
    flat = programs([mean] * len(ctx), bucket, heads, max_seq_len, sms, overhead)
    return makespan(mine, slots) - makespan(flat, slots)


# ---- the sweep --------------------------------------------------------------------------------
def sweep_points(
    path: Path,
) -> tuple[dict[str, Any], list[tuple[list[int], float, list[int], float]]]:
    """(sweep metadata, [(spread contexts in batch order, their ms, the control's, its ms)])
    of the decode(mix) families: each point's contexts are shapes_grid.mix_contexts' (the one
    spread whose sums match), longest first for decode(mix desc)."""
    cols, meta = read_sweep(path)
    label = cols["label"].astype(str)
    rows, kv, mx = (
        cols[k].astype(np.int64) for k in ("num_reqs", "kv_read_tokens", "max_kv_tokens")
    )
    found: dict[tuple[int, int, int, bool], tuple[list[int], float]] = {}
    for i in np.flatnonzero(np.isin(label, MIX_FAMILIES)):
        b, desc = int(rows[i]), label[i] == MIX_FAMILIES[1]
        mean = int(kv[i]) // b
        for s in MIX_SPREADS:
            ctx = mix_contexts(b, mean, s)
            if sum(ctx) == kv[i] and max(ctx) == mx[i]:
                found[(b, mean, s, bool(desc))] = (
                    sorted(ctx)[::-1] if desc else ctx,
                    float(cols["gpu_ms"][i]),
                )
                break
    out = []
    for (b, mean, s, _), (ctx, ms) in sorted(found.items()):
        control = found.get((b, mean, 0, False))
        if s and control is not None and b >= MIN_ROWS:
            out.append((ctx, ms, control[0], control[1]))
    return meta, out


def fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """y = c x, least squares, no intercept: (c, R^2 about 0)."""
    c = float(x @ y / (x @ x)) if x @ x > 0 else 0.0
    r = y - c * x
    return c, 1.0 - float(r @ r) / float(y @ y)


def sweep_fit(path: Path, blocks_per_sm: int | None) -> dict[str, Any]:
    """Section 1 of the output, as numbers."""
    meta, pts = sweep_points(path)
    model = get_model(str(meta["model"]))
    sms = num_sms(str(meta.get("gpu", "")))
    if sms is None:
        raise SystemExit(f"{path}: no SM count for GPU {meta.get('gpu')!r}")
    heads, max_len = model.kv_heads_per_rank(1), model.max_context
    per_sm = blocks_per_sm or BLOCKS_PER_SM[model.name]
    y = np.array([ms - base for _, ms, _, base in pts])

    def r2(slots: int) -> tuple[float, float]:
        x = np.array([excess(c, len(c), heads, max_len, sms, slots) for c, *_ in pts])
        return fit(x, y)

    tail = tail_keys_fn(heads, sms)
    keys = np.array(
        [tail(len(c), sum(c), max(c)) - tail(len(k), sum(k), max(k)) for c, _, k, _ in pts]
    )
    coef, r2_here = r2(per_sm * sms)
    return {
        "model": model.name, "gpu": meta.get("gpu"), "points": len(pts), "slots": per_sm * sms,
        "ms_per_key": coef, "r2": r2_here, "tail_keys_r2": fit(keys.astype(float), y)[1],
        "others": {k * sms: r2(k * sms)[1] for k in OTHER_SLOTS_PER_SM if k != per_sm},
        "heads": heads, "sms": sms,
    }  # fmt: skip


# ---- the runs ---------------------------------------------------------------------------------
def row_contexts(run_dir: Path) -> tuple[Any, dict[str, np.ndarray], list[tuple[int, int, int]]]:
    """(run, its step columns, [(prefill step, prompt tokens, output tokens)] in batch order).
    A request's first token is processed by its (last) prefill step; from the next step on it
    decodes one token a step until its last, at position prompt + (step - prefill step) - 1
    (keys read: prompt + step - prefill step), in the running list's order: admission order.
    A request preempted or otherwise off this pattern makes the steps it is in disagree with the
    recorded sums, which `rebuilt` checks."""
    run = load_run(run_dir)
    s, req = run.arrays("steps"), run.arrays("requests")
    summary = json.loads((run_dir / "summary.json").read_text())
    trace = pq.read_table(ROOT / summary["trace"]["path"], columns=["request_id", "prompt_len"])
    prompt = dict(
        zip(*(trace.column(c).to_pylist() for c in ("request_id", "prompt_len")), strict=True)
    )
    po = s["process_outputs_end_s"]
    order = np.argsort(po, kind="stable")
    ends = po[order]
    out = []
    for rid, first_s, n_out in zip(
        req["request_id"], req["first_token_s"], req["output_tokens"], strict=True
    ):
        i = int(np.searchsorted(ends, first_s))
        if i < ends.size and abs(ends[i] - first_s) <= 1e-7:
            out.append((int(order[i]), int(prompt[rid]), int(n_out)))
    return run, s, sorted(out)


def contexts(rows: list[tuple[int, int, int]], step: int) -> list[int]:
    """The keys each decoding row of `step` reads, in batch order (`row_contexts`)."""
    return [p + step - at for at, p, n in rows if at < step <= at + n - 1]


def rebuilt(
    rows: list[tuple[int, int, int]], s: dict[str, np.ndarray], step: int
) -> list[int] | None:
    """`contexts(rows, step)` where they reproduce the step's recorded rows and keys, else None."""
    ctx = contexts(rows, step)
    if len(ctx) == s["num_reqs"][step] and sum(ctx) == s["kv_read_tokens"][step]:
        return ctx
    return None


@dataclass(frozen=True)
class RunKernel:
    """A run's decode attention kernel: what `excess` takes besides a step's contexts."""

    heads: int
    max_len: int  # the key bound the decode graphs were captured with
    sms: int
    buckets: list[int]  # the decode graph buckets

    @classmethod
    def of(cls, run: Any, profile: dict[str, Any]) -> RunKernel:
        cfg = run_config(run)
        model = get_model(cfg.model)
        sms = num_sms(cfg.gpu) or num_sms(str(profile.get("gpu", "")))
        if sms is None:
            raise SystemExit(f"no SM count for GPU {cfg.gpu!r}")
        max_len = cfg.max_model_len or model.max_context
        return cls(model.kv_heads_per_rank(1), max_len, sms, decode_buckets(cfg.max_num_seqs))

    def excess(self, ctx: Sequence[int], slots: int) -> float:
        """`excess` of a step of these contexts, in the graph bucket that runs it."""
        bucket = next(b for b in self.buckets if b >= len(ctx))
        return excess(ctx, bucket, self.heads, self.max_len, self.sms, slots)


def _branch(profile: dict[str, Any], i: int) -> dict[str, Any]:
    """The profile with only branch i of its decode model, without a tail term."""
    decode = profile["gpu_pass"]["decode"]
    one = {k: v for k, v in decode["max"][i].items() if k != "tail_keys"}
    return {**profile, "gpu_pass": {**profile["gpu_pass"], "decode": one}}


def run_bands(
    run_dir: Path, profile: dict[str, Any], ms_per_key: float, slots: int, min_rows: int = 32
) -> Iterator[tuple[int, int, int, int, float, float, float]]:
    """Per band of >= min_rows rows: (lo, hi, steps rebuilt, steps, measured / predicted with
    the profile, without the tail term, with the makespan excess in its place), medians over
    the clean queued decode steps whose rebuilt contexts match the recorded count and keys."""
    if "max" not in profile["gpu_pass"]["decode"]:
        raise SystemExit("the profile's decode model has no tail branch ('max')")
    run, s, rows = row_contexts(run_dir)
    kernel = RunKernel.of(run, profile)
    for lo, hi, steps, meas, pred in clean_decode_bands(run, s, profile):
        if lo < min_rows:
            continue
        ok = np.zeros(steps.size, bool)
        ex = np.zeros(steps.size)
        for i, j in enumerate(steps.tolist()):
            ctx = rebuilt(rows, s, j)
            if ctx is not None:
                ok[i] = True
                ex[i] = kernel.excess(ctx, slots)
        # the tail term sits in the first branch: the excess takes its place there
        b0 = predicted_gpu_ms(run, _branch(profile, 0), s, steps)
        b1 = predicted_gpu_ms(run, _branch(profile, 1), s, steps)
        none, wave = np.maximum(b0, b1), np.maximum(b0 + ms_per_key * ex, b1)
        got = [_median_ratio(meas, x, ok) for x in (pred, none, wave)]
        yield lo, hi, int(ok.sum()), steps.size, *got


def _median_ratio(meas: np.ndarray, pred: np.ndarray, ok: np.ndarray) -> float:
    return float(np.median((meas / pred)[ok])) if ok.any() else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("sweep", type=Path)
    ap.add_argument("profile", type=Path)
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--blocks-per-sm", type=int, default=None)
    a = ap.parse_args()
    f = sweep_fit(a.sweep, a.blocks_per_sm)
    print(f"1. {a.sweep.name} ({f['model']}, {f['gpu']}): {f['points']} spread points at >= "
          f"{MIN_ROWS} rows against their controls")  # fmt: skip
    print(f"   makespan excess at {f['slots']} slots ({f['slots'] // f['sms']} blocks per SM): "
          f"{f['ms_per_key'] * 1e3:.4f} us per key, R^2 {f['r2']:.3f}; tail_keys: R^2 "
          f"{f['tail_keys_r2']:.3f}")  # fmt: skip
    print("   R^2 at other slots: " + ", ".join(f"{k}: {v:.3f}" for k, v in f["others"].items()))
    profile = json.loads(a.profile.read_text())
    if a.runs:
        print("2. clean queued decode steps, measured / predicted: the profile | no tail term | "
              "the makespan excess in its place; [the profile | the excess] over the first "
              "run's same band (as a profile levelled on that run would read)")  # fmt: skip
    first: dict[int, tuple[float, float]] = {}
    for n_run, path in enumerate(a.runs):
        print(f"   {path.name}")
        for lo, hi, ok, n, p, none, wave in run_bands(path, profile, f["ms_per_key"], f["slots"]):
            if n_run == 0:
                first[lo] = (p, wave)
            rel = ""
            if n_run and lo in first:
                rel = f"  [{p / first[lo][0]:.3f} | {wave / first[lo][1]:.3f}]"
            print(f"     rows {lo}-{hi - 1}: {p:.3f} | {none:.3f} | {wave:.3f} "
                  f"({ok} of {n} steps rebuilt){rel}")  # fmt: skip


if __name__ == "__main__":
    main()
