"""Every `--help` of `python -m sim` and `python -m replay` stands alone: every option and
subcommand is described, and no text points at a file the user may not have (docs/contracts.md,
a contract number, a source file)."""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Iterator
from importlib import import_module
from pathlib import Path

import pytest

import replay.__main__ as replay_main
import sim.__main__ as sim_main

ROOT = Path(__file__).resolve().parents[1]
# a pointer outside the help text: contracts.md, "Contract 3", "see bubblesim/plan/spec.py", "see
# sim.x"
POINTER = re.compile(
    r"contracts\.md|Contract \d|\b[\w.]+/[\w/]+\.(py|md)\b"
    r"|\bsee (sim|core|bubblesim|replay|engine)\b"
)


def parsers(p: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from parsers(sub, f"{path} {name}")


def texts(p: argparse.ArgumentParser) -> Iterator[tuple[str, str | None]]:
    """(what, its help text) for the parser, each argument and each subcommand."""
    yield "description", p.description
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for c in a._choices_actions:
                yield f"subcommand {c.dest}", c.help
        else:
            yield f"argument {'/'.join(a.option_strings) or a.dest}", a.help


ALL = [*parsers(sim_main.build_parser(), "sim"), *parsers(replay_main.build_parser(), "replay")]


def test_walks_every_command() -> None:
    names = {path for path, _ in ALL}
    for cmd in ("sim run", "sim whatif", "sim plan", "sim trace cut", "replay run"):
        assert cmd in names
    assert len(names) >= 14


@pytest.mark.parametrize("path,parser", ALL, ids=[path for path, _ in ALL])
def test_every_option_is_described(path: str, parser: argparse.ArgumentParser) -> None:
    for what, text in texts(parser):
        if what == "description":
            continue  # optional: the subcommand's help line describes it in the parent
        assert text and text.strip(), f"{path}: {what} has no help"


@pytest.mark.parametrize("path,parser", ALL, ids=[path for path, _ in ALL])
def test_no_help_points_elsewhere(path: str, parser: argparse.ArgumentParser) -> None:
    for what, text in texts(parser):
        if text:
            hit = POINTER.search(text)
            assert hit is None, f"{path}: {what} points at {hit.group(0)!r}: {text!r}"
    parser.format_help()  # renders (a bad %-format in a help string raises here)


def test_console_scripts_resolve() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"bubblesim", "bubblesim-replay"}
    for target in scripts.values():
        module, _, fn = target.partition(":")
        assert callable(getattr(import_module(module), fn))


def test_console_script_runs_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    argv = sys.argv
    sys.argv = ["bubblesim", "trace", "info", str(ROOT / "traces" / "smoke.parquet")]
    try:
        assert sim_main.console() == 0
    finally:
        sys.argv = argv
    assert "requests" in capsys.readouterr().out
    for console, name in (
        (sim_main.console, "bubblesim"),
        (replay_main.console, "bubblesim-replay"),
    ):
        sys.argv = [name, "--help"]
        try:
            with pytest.raises(SystemExit) as done:
                console()
        finally:
            sys.argv = argv
        assert done.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: {name} ")
