"""Subcommands of `python -m sim`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from core.cli import add_config_args, config_from_args
from sim.cost.envelope import describe


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="a predicted run of a trace (Contract 3 run folder)")
    p.add_argument("trace", help="trace parquet file")
    add_config_args(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run)
    _optional(sub, "sim.tracecmd", "add_trace_parser")
    _optional(sub, "sim.whatif", "add_whatif_parser")
    _optional(sub, "sim.plan", "add_plan_parser")


def _optional(sub: argparse._SubParsersAction, module: str, fn: str) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return
    getattr(mod, fn)(sub)


class Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < 0.1:
            return
        self._last = now
        sys.stderr.write(f"\r{self.label}: step {done:,}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")


def cmd_run(args: argparse.Namespace) -> int:
    from sim.report import print_summary
    from sim.run import simulate

    cfg = config_from_args(args)
    out = Path(args.output or Path("runs") / f"sim-{Path(args.trace).stem}")
    bar = Progress(f"simulating {Path(args.trace).name}", not args.quiet)
    try:
        res = simulate(cfg, args.trace, out, progress=bar)
    finally:
        bar.close()
    print_summary(res.summary, out, res.wall_s)
    line = describe(res.summary.get("cost_envelope") or {})
    if line:
        print(line)
    return 0
