"""Subcommands of `python -m sim`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from bubblesim.core.cli import UsageError, add_config_args, check_names
from bubblesim.core.cli_timeline import add_timeline_args
from bubblesim.core.config import Config
from bubblesim.core.scenario import Scenario, config_for_trace
from sim.cost.envelope import describe
from sim.progress import Progress


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
    from bubblesim.core.outplace import RUN_FOLDER, output_place
    from sim.report import print_summary
    from sim.run import simulate
    from sim.seeds import MAX_SEEDS

    if not 1 <= args.seeds <= MAX_SEEDS:
        raise UsageError(f"--seeds {args.seeds}: expected 1 to {MAX_SEEDS}")
    cfg, scenario = trace_config(args)
    band_profile = None
    if args.host_band:  # before anything is written: a profile without states is an error
        from sim.hostband import check_band

        band_profile = check_band(cfg)
    out = Path(args.output or Path("runs") / f"sim-{Path(args.trace).stem}")
    bar = Progress(f"simulating {Path(args.trace).name}", 0.0, enabled=not args.quiet)
    try:
        with output_place(out, RUN_FOLDER, args.force):
            res = simulate(
                cfg,
                args.trace,
                out,
                progress=bar if bar.enabled else None,  # quiet: no looks, longer segments
                timeline_steps=args.timeline_steps,
                timeline_from_s=args.timeline_from_s,
                steps=not args.no_steps,
                scenario=scenario,
            )
    finally:
        bar.close()
    summary = res.summary
    if args.seeds > 1:
        summary = _seed_spread(args, cfg, scenario, out, summary)
    if band_profile is not None:
        summary = _host_band(args, cfg, scenario, out, band_profile)
    print_summary(summary, out, res.wall_s)
    line = describe(summary.get("cost_envelope") or {})
    if line:
        print(line)
    if args.seeds > 1:
        from sim.seeds import SPREAD_KEY, spread_lines

        print("\n".join(spread_lines(summary[SPREAD_KEY])))
    if band_profile is not None:
        from sim.hostband import BAND_KEY, band_lines

        print("\n".join(band_lines(summary[BAND_KEY])))
    return 0


def _seed_spread(
    args: argparse.Namespace, cfg: Config, scenario: Scenario | None, out: Path, summary: dict
) -> dict:
    """The other seeds' runs (no step records), their spread added to the folder's summary."""
    from sim.seeds import SPREAD_KEY, add_to_summary, other_seeds, seed_spread

    last = cfg.seed + args.seeds - 1
    run = _side_run(args, scenario, lambda c: f"seed {c.seed} of {cfg.seed}..{last}")
    others = other_seeds(cfg, args.seeds, run)
    return add_to_summary(out, SPREAD_KEY, seed_spread([summary, *others], cfg.seed))


def _host_band(
    args: argparse.Namespace, cfg: Config, scenario: Scenario | None, out: Path, profile: dict
) -> dict:
    """The fast and the slow host's runs (no step records), added to the folder's summary."""
    from sim.hostband import BAND_KEY, host_band
    from sim.seeds import add_to_summary

    run = _side_run(args, scenario, lambda c: f"host band: host_scale {c.host_scale:.3f}")
    return add_to_summary(out, BAND_KEY, host_band(cfg, profile, run))


def _side_run(
    args: argparse.Namespace, scenario: Scenario | None, say: Callable[[Config], str]
) -> Callable[[Config, Path], dict]:
    """A run of the trace under another config, without step records (the extra runs of
    --seeds and --host-band): its summary; says `say(config)` first unless quiet."""
    from sim.run import simulate

    def run(c: Config, folder: Path) -> dict:
        if not args.quiet:
            print(say(c), flush=True)
        return simulate(c, args.trace, folder, steps=False, scenario=scenario).summary

    return run
