"""Capacity planning (`python -m sim plan`): over candidate GPUs, models, engine configs and
replica counts, the smallest fleet and the best config that meet latency SLOs at a trace's
load, and the highest load one replica sustains. Importing this package stays light: the
command's modules load when it runs."""

from __future__ import annotations

import argparse


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from bubblesim.plan.cli import add_plan_parser as add

    add(sub)


__all__ = ["add_plan_parser"]
