"""`python -m sim run|whatif|plan|trace ...` (DESIGN.md Contract 4)."""

from __future__ import annotations

import argparse
import sys

from core.cli import run_main
from sim import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_commands(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(run_main(main))
