"""Subcommands of `python -m sim`."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from bubblesim.core.cli import UsageError, add_config_args, check_names
from bubblesim.core.cli_timeline import add_timeline_args
from bubblesim.core.config import Config
from bubblesim.core.scenario import Scenario, config_for_trace
from sim.cost.envelope import describe
from sim.progress import Progress

if TYPE_CHECKING:  # imported by cmd_run: a plain run does not load the pool's modules
    from sim.siderun import SideRuns

DEFAULT_JOBS = 4  # --jobs: at most this many extra runs at once (and at most the CPUs)


def add_commands(sub: argparse._SubParsersAction, command: str | None = None) -> None:
    """Every subcommand; `command` "run" (the word the command line starts with) adds `run`
    alone, so a run does not import the planner's, whatif's and the trace tools' modules."""
    p = sub.add_parser(
        "run", help="a predicted run of a trace: a run folder (requests, steps, summary, timeline)"
    )
    p.add_argument("trace", help="trace parquet file")
    add_config_args(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or progress lines")
    add_timeline_args(p)
    p.add_argument(
        "--no-steps",
        action="store_true",
        help="leave out the step records (steps.parquet, timeline.json): summary.json, "
        "requests.parquet and gc.parquet only, for planning-style runs",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="also run seeds seed+1 .. seed+N-1 and add their spread to summary.json "
        "(seed_spread; sim.seeds): how much of a prediction is the seeded host's draw",
    )
    p.add_argument(
        "--host-band",
        action="store_true",
        help="also predict on a host that stays in the fast and in the slow of the profile's "
        "two speed states (host_speed.states; sim.hostband) and add the band to summary.json",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="processes for the extra runs of --seeds and --host-band, which then run beside "
        f"the main one (default min(CPUs, {DEFAULT_JOBS})); 1: one after another after it, "
        "in this process. The results are the same",
    )
    add_scenario_arg(p)
    p.set_defaults(func=cmd_run)
    if command == "run":
        return
    _optional(sub, "bubblesim.workloads.tracecmd", "add_trace_parser")
    _optional(sub, "sim.whatif", "add_whatif_parser")
    _optional(sub, "bubblesim.plan", "add_plan_parser")


def _optional(sub: argparse._SubParsersAction, module: str, fn: str) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return
    getattr(mod, fn)(sub)


def add_scenario_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-scenario",
        action="store_true",
        help="ignore the scenario config the trace carries (bubblesim.core.scenario)",
    )


def trace_config(args: argparse.Namespace) -> tuple[Config, Scenario | None]:
    """The config for `args.trace`: defaults < its scenario < --config < --set; says so
    when a scenario was applied (stdout, before any result)."""
    cfg, scenario = config_for_trace(args.trace, args.config, args.sets, not args.no_scenario)
    check_names(cfg)
    if scenario is not None:
        print(scenario.line(), flush=True)
    return cfg, scenario


def cmd_run(args: argparse.Namespace) -> int:
    from bubblesim.core.atomic import replacing_dir
    from bubblesim.core.outplace import RUN_FOLDER, output_place
    from sim.run import simulate
    from sim.seeds import MAX_SEEDS
    from sim.siderun import SideRuns

    if not 1 <= args.seeds <= MAX_SEEDS:
        raise UsageError(f"--seeds {args.seeds}: expected 1 to {MAX_SEEDS}")
    jobs = min(os.cpu_count() or 1, DEFAULT_JOBS) if args.jobs is None else args.jobs
    if jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: expected 1 or more")
    cfg, scenario = trace_config(args)
    band_profile = None
    if args.host_band:  # before anything is written: a profile without states is an error
        from sim.hostband import check_band

        band_profile = check_band(cfg)
    out = Path(args.output or Path("runs") / f"sim-{Path(args.trace).stem}")
    extra = args.seeds - 1 + (2 if band_profile is not None else 0)
    with SideRuns(args.trace, scenario, jobs, extra) as side:
        seeds, band = _add_side_runs(side, args, cfg, band_profile)
        bar = Progress(f"simulating {Path(args.trace).name}", 0.0, enabled=not args.quiet)
        # with extra runs the folder is built beside `out` and swapped in once its summary
        # holds their results: a failed or interrupted wait for them leaves `out` as it was
        with (
            output_place(out, RUN_FOLDER, args.force),
            replacing_dir(out) if extra else contextlib.nullcontext(out) as place,
        ):
            try:
                res = simulate(
                    cfg,
                    args.trace,
                    place,
                    progress=bar if bar.enabled else None,  # quiet: no looks, longer segments
                    timeline_steps=args.timeline_steps,
                    timeline_from_s=args.timeline_from_s,
                    steps=not args.no_steps,
                    scenario=scenario,
                )
            finally:
                bar.close()
            summary = res.summary
            if extra:
                summary = _add_side_results(side, args, cfg, place, summary, seeds, band)
    _print_run(summary, out, res.wall_s, args.seeds > 1, band_profile is not None)
    return 0


def _add_side_runs(
    side: SideRuns, args: argparse.Namespace, cfg: Config, band_profile: dict | None
) -> tuple[list[Config], dict[str, Config]]:
    """The extra runs of --seeds and --host-band, added to `side` (seeds first)."""
    from sim.seeds import seed_configs

    seeds = seed_configs(cfg, args.seeds)
    last = cfg.seed + args.seeds - 1
    for c in seeds:
        side.add(f"seed {c.seed} of {cfg.seed}..{last}", c)
    band: dict[str, Config] = {}
    if band_profile is not None:
        from sim.hostband import band_configs

        band = band_configs(cfg, band_profile, side.folder)
        for c in band.values():
            side.add(f"host band: host_scale {c.host_scale:.3f}", c)
    return seeds, band


def _add_side_results(
    side: SideRuns, args: argparse.Namespace, cfg: Config, out: Path, summary: dict,
    seeds: list[Config], band: dict[str, Config],
) -> dict:  # fmt: skip
    """The extra runs' seed spread and host band, added to the folder's summary.json."""
    from sim.seeds import SPREAD_KEY, add_to_summary, seed_spread

    got = side.results(None if args.quiet else lambda line: print(line, flush=True))
    if seeds:
        spread = seed_spread([summary, *got[: len(seeds)]], cfg.seed)
        summary = add_to_summary(out, SPREAD_KEY, spread)
    if band:
        from sim.hostband import BAND_KEY, band_value

        summary = add_to_summary(out, BAND_KEY, band_value(band, got[len(seeds) :]))
    return summary


def _print_run(summary: dict, out: Path, wall_s: float, seeds: bool, band: bool) -> None:
    """The summary, the cost envelope's line, and the seed spread's and band's lines."""
    from sim.report import print_summary

    print_summary(summary, out, wall_s)
    line = describe(summary.get("cost_envelope") or {})
    if line:
        print(line)
    if seeds:
        from sim.seeds import SPREAD_KEY, spread_lines

        print("\n".join(spread_lines(summary[SPREAD_KEY])))
    if band:
        from sim.hostband import BAND_KEY, band_lines

        print("\n".join(band_lines(summary[BAND_KEY])))
