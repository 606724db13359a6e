"""Cost of the engine's step hooks alone (engine.hooks.StepHooks), in ns per step; prints a table,
writes JSON rows with --json PATH.

    python bench/hooks_overhead.py [--device cpu|cuda] [--steps N] [--trials K] [--json PATH]

Each row is the median (and the minimum) over K trials of N iterations on fresh hooks, minus an
empty loop of N iterations:
- step: the hook calls of one plain engine step (`replay.gpu.measure.step_hook_calls`: six
  begin/end pairs, new_row, the GPU begin/end marks, a sync wait, the `finished` store) with the
  engine's default event ring (256 steps), so on CUDA each step also reads the events of the
  step 256 before; step_within_ring: a ring longer than the run, as the replay's measured run
  has, so no step reads events (`finish()` does, after the run);
- step_legacy_events (CUDA): `step` with the event calls the hooks made before (Event.record()
  with its current_stream() lookup, Event.elapsed_time through the Python wrapper);
- phase: one begin/end pair; new_row; gpu_marks: gpu_begin + gpu_end (default ring); sync:
  sync_begin + sync_end; finished: the engine's `hooks.finished[row] = n`; gc_pair: the GC
  callback's start + stop;
- replay_estimate / replay_estimate_within_ring: what `replay.gpu.measure.hook_overhead` reports
  (summary.json `replay.instrumentation.per_step_us`) for a run longer / shorter than its ring.
On CUDA the events go to an idle stream; on CPU the GPU marks are host clock reads.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bubblesim.core import phases as P  # noqa: E402
from bubblesim.core.shape import BatchShape  # noqa: E402
from engine.hooks import StepHooks  # noqa: E402
from replay.gpu.measure import hook_overhead, step_hook_calls  # noqa: E402

SHAPE = BatchShape(num_reqs=1, decode_tokens=1)
_now = time.perf_counter_ns
CASES = ("step", "step_within_ring", "step_legacy_events", "phase", "new_row", "gpu_marks",
         "sync", "finished", "gc_pair")  # fmt: skip


def _loop_ns(body: Callable[[], None], n: int) -> int:
    t = _now()
    for _ in range(n):
        body()
    return _now() - t


def _empty() -> None:
    return None


def _hooks(case: str, device: torch.device, n: int) -> StepHooks:
    ring = n + 600 if case == "step_within_ring" else 256
    h = StepHooks(device, ring=ring)
    if case == "step_legacy_events":  # the calls gpu_begin/gpu_end/_harvest made before
        h.record_event = torch.cuda.Event.record  # (event, None): a current_stream() lookup
        h.elapsed_ms = torch.cuda.Event.elapsed_time
    h.start()
    if case == "step_legacy_events":
        h.stream = None
    return h


def _body(case: str, h: StepHooks) -> Callable[[], None]:
    row = h.new_row(SHAPE)
    info = {"generation": 0, "collected": 0, "uncollectable": 0}

    def step() -> None:
        step_hook_calls(h, SHAPE)

    def phase() -> None:
        h.begin(P.LAUNCH)
        h.end(row)

    def new_row() -> None:
        h.new_row(SHAPE)

    def gpu_marks() -> None:
        r = h.new_row(SHAPE)  # a row per iteration, as steps use the event ring
        h.gpu_begin(r)
        h.gpu_end(r)

    def sync() -> None:
        h.sync_end(row, h.sync_begin())

    def finished() -> None:
        h.finished[row] = 1

    def gc_pair() -> None:
        h.on_gc("start", info)
        h.on_gc("stop", info)

    if case.startswith("step"):
        return step
    cases = dict(phase=phase, new_row=new_row, gpu_marks=gpu_marks, sync=sync,
                 finished=finished, gc_pair=gc_pair)  # fmt: skip
    return cases[case]


def time_case(case: str, device: torch.device, n: int, trials: int) -> tuple[float, float]:
    """(median, min) ns per iteration over `trials` fresh hooks, less an empty loop."""
    samples = []
    for _ in range(trials):
        h = _hooks(case, device, n)
        for _ in range(300):  # first calls, and a full default ring: harvests from here on
            step_hook_calls(h, SHAPE)
        body = _body(case, h)
        gc.collect()
        gc.disable()
        try:
            base = _loop_ns(_empty, n)
            took = _loop_ns(body, n)
        finally:
            gc.enable()
        h.finish()
        samples.append((took - base) / n)
    return statistics.median(samples), min(samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for case in CASES:
        if case == "step_legacy_events" and device.type != "cuda":
            continue
        med, low = time_case(case, device, args.steps, args.trials)
        rows.append({"case": case, "ns_per_step": med, "min_ns_per_step": low})
    for name, harvests in (("replay_estimate", True), ("replay_estimate_within_ring", False)):
        est = [hook_overhead(device, harvests=harvests)["per_step_us"] * 1e3 for _ in range(3)]
        med = statistics.median(est)
        rows.append({"case": name, "ns_per_step": med, "min_ns_per_step": min(est)})
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"hook cost per step on {name} ({args.steps:,} iterations x {args.trials} trials)")
    print(f"{'case':<28} {'median ns':>10} {'min ns':>8}")
    for r in rows:
        print(f"{r['case']:<28} {r['ns_per_step']:10.0f} {r['min_ns_per_step']:8.0f}")
    if args.json is not None:
        meta = {"device": name, "steps": args.steps, "trials": args.trials,
                "python": sys.version.split()[0], "torch": torch.__version__}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
