"""`python -m sim run|whatif|plan|trace ...`: predict an LLM engine's GPU idle time (bubbles)
from a request trace, what each engine change would buy, and the fleet a workload needs."""

from __future__ import annotations

import argparse
import sys

from bubblesim.core.cli import run_main
from sim import cli


def build_parser(
    prog: str = "python -m sim", command: str | None = None
) -> argparse.ArgumentParser:
    """The parser; `command`: the first word of the command line (sim.cli.add_commands)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_commands(sub, command)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m sim") -> int:
    words = sys.argv[1:] if argv is None else argv
    args = build_parser(prog, words[0] if words else None).parse_args(argv)
    return int(args.func(args) or 0)


def console() -> int:
    """The `bubblesim` console script (pyproject.toml [project.scripts])."""
    return run_main(lambda argv: main(argv, prog="bubblesim"))


if __name__ == "__main__":
    sys.exit(run_main(main))
