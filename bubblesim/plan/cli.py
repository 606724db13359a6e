"""`python -m sim plan TRACE --slo ttft_p99_s=X ...` (docs/contracts.md Contract 4)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from bubblesim.core.cli import add_config_args, config_from_args
from bubblesim.core.outplace import OutKind, output_place
from bubblesim.plan.report import sustains
from bubblesim.plan.spec import ROUTERS, SLO_KEYS, PlanError, load_plan_spec
from bubblesim.plan.sweep import SweepStats

# an earlier plan folder (resumed, not replaced: its points are reused unless --fresh)
PLAN_FOLDER = OutKind(
    "plan folder", folder=True, markers=("points.jsonl", "plan.json", "report.html")
)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="capacity planning: the smallest fleet and best config that meet latency SLOs",
        description="Over candidate configs and replica counts, find the cheapest fleet that "
        "meets the SLOs at the trace's load and the highest load one replica sustains; writes "
        "DIR/plan.json, DIR/report.html and DIR/points.jsonl (a rerun skips finished points).",
    )
    p.add_argument("trace", help="trace parquet file")
    p.add_argument(
        "--slo",
        action="append",
        dest="slos",
        metavar="KEY=SECONDS",
        help=f"a latency SLO (repeatable); KEY one of {', '.join(SLO_KEYS)}",
    )
    p.add_argument(
        "--candidates",
        metavar="FILE.toml",
        help="TOML file of candidates: [grid] lists values per config key (a product), each "
        "[[config]] adds its own, [prices] gives USD per GPU-hour by GPU name, [search] sets "
        "search options (max_replicas, loads, max_load_factor, ...)",
    )
    p.add_argument(
        "--vary",
        action="append",
        metavar="KEY=V1,V2",
        default=[],
        help="add a grid dimension, e.g. --vary batches_in_flight=1,2,3",
    )
    add_config_args(p)
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="local worker processes (default: all cores; 1 = serial)",
    )
    p.add_argument(
        "--ray", metavar="ADDRESS", help="run points on a Ray cluster (`local` starts one here)"
    )
    p.add_argument(
        "--loads",
        metavar="X,Y,...",
        help="trace-load multiples to size fleets for (1 is always included)",
    )
    p.add_argument(
        "--max-replicas",
        type=int,
        metavar="N",
        help="largest fleet tried per candidate and load (default 64)",
    )
    p.add_argument("--router", choices=ROUTERS, help="router for candidates that name none")
    p.add_argument(
        "--tp",
        metavar="N,M,...",
        help="tensor_parallel_size degrees (GPUs per replica) to try for candidates that set "
        "none (default: 1 for a model that fits one GPU, else the smallest degree at which it "
        "fits and the next, up to 8)",
    )
    p.add_argument(
        "--no-early-stop",
        action="store_true",
        help="run every point to the end, even once it surely violates an SLO",
    )
    p.add_argument("--fresh", action="store_true", help="ignore points of an earlier run in DIR")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_plan)


def _search_over(args: argparse.Namespace) -> dict[str, Any]:
    over: dict[str, Any] = {}
    if args.loads:
        try:
            over["loads"] = [float(x) for x in args.loads.split(",") if x.strip()]
        except ValueError:
            raise PlanError(f"--loads '{args.loads}': expected numbers like 1,2,4") from None
    if args.max_replicas is not None:
        over["max_replicas"] = args.max_replicas
    if args.router:
        over["router"] = args.router
    if args.no_early_stop:
        over["early_stop"] = False
    if args.tp:
        try:
            over["tensor_parallel"] = [int(x) for x in args.tp.split(",") if x.strip()]
        except ValueError:
            raise PlanError(f"--tp '{args.tp}': expected degrees like 1,2,4,8") from None
    return over


class _Progress:
    """Points run so far (a search does not know its total in advance): a redrawn line on a
    terminal, elsewhere a plain line every LOG_EVERY_S seconds; nothing with -q."""

    LOG_EVERY_S = 10.0

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self._last = self.t0 if not self.tty else 0.0

    def __call__(self, st: SweepStats, running: int) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < (0.2 if self.tty else self.LOG_EVERY_S):
            return
        self._last = now
        text = (
            f"plan: {st.run} points run, {st.cached} reused, {running} running, "
            f"{now - self.t0:.0f} s"
        )
        sys.stderr.write(f"\r{text}" if self.tty else f"{text}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r\033[K")


def cmd_plan(args: argparse.Namespace) -> int:
    from bubblesim.plan.planner import run_plan
    from bubblesim.plan.report import write_report
    from bubblesim.plan.sweep import make_executor

    cfg = config_from_args(args)
    spec = load_plan_spec(args.slos, cfg, args.candidates, args.vary, _search_over(args))
    if args.jobs < 1:
        raise PlanError("--jobs must be >= 1")
    out = Path(args.output or Path("runs") / f"plan-{Path(args.trace).stem}")
    if not Path(args.trace).is_file():
        raise PlanError(f"trace '{args.trace}': no such file")
    with output_place(out, PLAN_FOLDER, args.force):
        executor = make_executor(args.jobs, args.ray, args.trace)
        bar = _Progress(not args.quiet)
        try:
            plan = run_plan(args.trace, spec, out, executor, not args.fresh, bar)
        finally:
            bar.close()
        write_report(plan, out / "report.html")
    print_plan(plan, out)
    return 0


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _load(c: dict[str, Any]) -> str:
    return ("≥" if c["max_load_capped"] else "") + format(c["max_load_factor"], ".3g") + "x"


def print_plan(plan: dict[str, Any], out: Path) -> None:
    st = plan["stats"]
    tr = plan["trace"]
    print(
        f"plan -> {out}  ({len(plan['candidates'])} candidates, {st['points_run']} points run, "
        f"{st['points_cached']} reused, {st['wall_s']:.1f} s)"
    )
    print(
        f"  trace: {tr['rows']} requests, {tr['req_per_s']:.2f} req/s; SLOs: "
        + ", ".join(f"{k} <= {v:g}" for k, v in plan["slos"].items())
    )
    rows = sorted(
        plan["candidates"],
        key=lambda c: (c["cost_per_mtok"] is None, c["cost_per_mtok"] or 0, c["index"]),
    )
    print(f"  {'candidate':<44} {'replicas':>8} {'$/Mtok':>8} {'max load':>9} {'req/s':>8}")
    for c in rows[:15]:
        print(
            f"  {c['name'][:44]:<44} {_fmt(c['replicas'], 'd'):>8} "
            f"{_fmt(c['cost_per_mtok'], '.3f'):>8} "
            f"{_load(c):>9} "
            f"{c['max_load_req_per_s']:>8.2f}"
        )
    if len(rows) > 15:
        print(f"  ... {len(rows) - 15} more in plan.json")
    if any(c["max_load_capped"] for c in rows):
        cap = plan["search"]["max_load_factor"]
        print(
            f"  ≥: at least that: the load search stopped at its cap ({cap:g}x the trace's load) "
            "still meeting the SLOs (raise max_load_factor in the candidates file's [search], or "
            "use a longer or denser trace)"
        )
    best = plan["best"]
    if best is None:
        print("  no candidate meets the SLOs at the trace's load (see report.html)")
    else:
        tp = best.get("gpus_per_replica", 1)
        per = f" of {tp} GPUs ({best['gpus']} in all)" if tp > 1 else ""
        print(
            f"  best: {best['candidate']} x {best['replicas']} replica(s){per}, "
            f"${best['cost_per_mtok']:.3f} per million output tokens; one replica sustains "
            f"{sustains(best)} the trace's load"
        )
