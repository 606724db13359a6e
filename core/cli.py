"""Pieces shared by every command line (`python -m sim ...`, `python -m replay ...`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from core.config import Config, ConfigError, load_config


class UsageError(Exception):
    """Bad input found by a command: printed as one line, exit code 2."""


def add_config_args(p: argparse.ArgumentParser, output: bool = True) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="sets",
        help="override a config key, e.g. --set spec.k=4 (repeatable)",
    )
    if output:
        p.add_argument("-o", "--output", metavar="DIR", help="output folder")


def config_from_args(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.sets)


def fail(msg: str) -> NoReturn:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a command's main; turn known bad-input errors into one line and exit code 2."""
    from core.trace import TraceError  # local: keeps `core.cli` light

    try:
        return main(argv)
    except (ConfigError, TraceError, UsageError, FileNotFoundError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
