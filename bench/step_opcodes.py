"""Bytecodes a simulated step executes, against the bare SimPy pipeline's (issue 15's baseline).

    python bench/step_opcodes.py                    # the Azure hour's first 120 s
    python bench/step_opcodes.py --limit-s 60 \
        --set profile=reports/fidelity/gen/profile-h100-llama3-8b.json
    python bench/step_opcodes.py --write rows.json

bench/sim_speed.py times the loop against a bare two-process SimPy pipeline stepping as many
times, on a shared machine whose speed moves by 2x from hour to hour. This counts what does not
move with the hour: the Python bytecodes (and calls into C functions) each executes per step,
under sys.settrace / sys.setprofile, by the file whose code runs them. The counts are exact and
the same on every machine of one Python version; they leave out the time inside C functions
(struct packing, list appends, heap operations), which is why the untraced us per bytecode of
both is printed beside them.

Read with it: loop/bare <= 0.3 asks the loop to run a step in 0.3x the bare pipeline's time. At
the loop's own untraced cost per bytecode, that is a budget of bytecodes per step, which the
table prints beside what the step loop's parts execute (`StepClock.step`, the one phase block
shared by the step loop and the fast path, alone takes a share of it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from sim_speed import BASE_SETS, LOOP_TARGET, bare_env  # noqa: E402

from bubblesim.core.config import load_config  # noqa: E402
from bubblesim.core.trace import read_trace, write_trace  # noqa: E402
from sim.loop import SimLoop  # noqa: E402
from sim.run import simulate  # noqa: E402


class Counts:
    """Bytecodes and C calls counted by the file of the code that runs them."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.c_calls = 0

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.ops[frame.f_code.co_filename] += 1
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return self._local

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            self.c_calls += 1

    def __enter__(self) -> Counts:
        sys.setprofile(self._profile)
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)
        sys.setprofile(None)

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def group(filename: str) -> str:
    """A file's part of the product: the phase block, the fast path, costs, policy, other."""
    if filename == "<string>":
        return "generated (cost model, setters)"
    p = Path(filename)
    try:
        rel = p.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return "simpy" if "simpy" in p.parts else "stdlib, imports"
    if rel == "sim/clock.py":
        return "StepClock.step (sim/clock.py)"
    for prefix, name in (
        ("sim/fast/", "fast path (sim/fast)"),
        ("sim/cost/", "costs (sim/cost)"),
        ("sim/stepcosts.py", "costs (sim/cost)"),
        ("bubblesim/core/policy/", "policy and blocks"),
        ("bubblesim/core/runfmt/", "records (runfmt)"),
        ("sim/", "step loop (sim/)"),
    ):
        if rel.startswith(prefix):
            return name
    return "other (repository)"


def bare(num_steps: int) -> tuple[Counts, float]:
    """The bare pipeline's counts for `num_steps`, and its untraced seconds."""
    env, done = bare_env(num_steps)
    with Counts() as counts:
        env.run(done)
    env, done = bare_env(num_steps)
    t0 = time.perf_counter()
    env.run(done)
    return counts, time.perf_counter() - t0


def loop(trace: str, sets: list[str]) -> tuple[Counts, int, float]:
    """The step loop's counts on `trace` (SimLoop.run only), its steps and untraced seconds."""
    cfg = load_config(None, [*BASE_SETS, *sets])
    orig = SimLoop.run
    out: dict[str, Any] = {}

    def counted(self: SimLoop) -> None:
        with Counts() as counts:
            orig(self)
        out["counts"] = counts

    def timed(self: SimLoop) -> None:
        t0 = time.perf_counter()
        orig(self)
        out["s"] = time.perf_counter() - t0

    try:
        SimLoop.run = counted  # type: ignore[method-assign]
        steps = simulate(cfg, trace).recorder.num_steps
        SimLoop.run = timed  # type: ignore[method-assign]
        simulate(cfg, trace)
    finally:
        SimLoop.run = orig  # type: ignore[method-assign]
    return out["counts"], steps, out["s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="traces/azure_conv.parquet")
    ap.add_argument("--limit-s", type=float, default=120.0, help="the trace's first S seconds")
    ap.add_argument("--set", action="append", default=[], help="config key=value, as sim run")
    ap.add_argument("--write", help="write the rows as JSON")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tr = read_trace(ROOT / args.trace)
        part = Path(tmp) / "trace.parquet"
        write_trace(tr.take(np.flatnonzero(tr.arrival_s < args.limit_s)), part)
        lc, steps, loop_s = loop(str(part), args.set)
    bc, bare_s = bare(steps)

    loop_ops, bare_ops = lc.total / steps, bc.total / steps
    loop_ns, bare_ns = 1e9 * loop_s / lc.total, 1e9 * bare_s / bc.total
    budget = LOOP_TARGET * bare_s / steps * 1e9 / loop_ns  # bytecodes a step at loop/bare 0.3
    by_part: Counter[str] = Counter()
    for f, n in lc.ops.items():
        by_part[group(f)] += n
    print(f"{args.trace}, first {args.limit_s:g} s, sets {args.set or '-'}: {steps:,} steps")
    print(f"{'':34} {'ops/step':>9} {'C calls/step':>13} {'us/step':>8} {'ns/op':>6}")
    print(f"{'bare SimPy pipeline':34} {bare_ops:9.1f} {bc.c_calls / steps:13.1f} "
          f"{1e6 * bare_s / steps:8.2f} {bare_ns:6.1f}")  # fmt: skip
    print(f"{'the step loop (SimLoop.run)':34} {loop_ops:9.1f} {lc.c_calls / steps:13.1f} "
          f"{1e6 * loop_s / steps:8.2f} {loop_ns:6.1f}")  # fmt: skip
    for part_name, n in by_part.most_common():
        print(f"  {part_name:32} {n / steps:9.1f}")
    print(f"loop/bare {loop_s / bare_s:.2f} (untraced, this hour); loop/bare <= {LOOP_TARGET} at "
          f"the loop's {loop_ns:.1f} ns/op: <= {budget:.0f} ops a step, "
          f"against {loop_ops:.0f}")  # fmt: skip
    if args.write:
        row = {
            "trace": args.trace, "limit_s": args.limit_s, "sets": args.set, "steps": steps,
            "bare_ops_per_step": bare_ops, "loop_ops_per_step": loop_ops,
            "bare_c_calls_per_step": bc.c_calls / steps,
            "loop_c_calls_per_step": lc.c_calls / steps,
            "bare_s": bare_s, "loop_s": loop_s, "budget_ops_per_step": budget,
            "loop_ops_per_step_by_part": {k: v / steps for k, v in by_part.items()},
        }  # fmt: skip
        Path(args.write).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
