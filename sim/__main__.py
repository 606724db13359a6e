"""`python -m sim run|whatif|plan|trace ...`: predict an LLM engine's GPU idle time (bubbles)
from a request trace, what each engine change would buy, and the fleet a workload needs."""

from __future__ import annotations

import argparse
import sys

from core.cli import run_main
from sim import cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


def console() -> int:
    """The `bubblesim` console script (pyproject.toml [project.scripts])."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(run_main(main))
