"""`python -m replay run|compare|calibrate|shapes|ablate ...`: run a trace through the real
engine (a GPU, or a small model on the CPU), compare the measured run with a predicted one, and
fit the simulator's cost profile from measured runs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bubblesim.core.cli import Terminated, UsageError, add_config_args, config_from_args, run_main
from bubblesim.core.cli_timeline import add_timeline_args, timeline_line
from bubblesim.core.config import ConfigError
from bubblesim.core.models import get_model
from bubblesim.core.outplace import RUN_FOLDER, OutKind, atomic_dir, check_place, output_place


class _Progress:
    """One status line on stderr (a terminal only), redrawn at most twice a second."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if self.enabled and now - self._last > 0.5:
            self._last = now
            sys.stderr.write(f"\r\033[K{text}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")


def _partial(e: BaseException, out: Path) -> str:
    """replay.gpu.run marks the exceptions after which it wrote a partial run folder."""
    return f": partial run (complete: false) -> {out}" if getattr(e, "partial_run", None) else ""


# ---- run ----------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    # lazy (as every command's imports here): `--help` and the other commands skip torch, numpy
    from bubblesim.core.trace import TraceError
    from replay.analysis.report import print_run_summary
    from replay.gpu.run import ReplayTimeout, replay

    cfg = config_from_args(args)
    out = Path(args.output or Path("runs") / f"replay-{Path(args.trace).stem}")
    if args.repeat < 1:
        raise UsageError("--repeat must be >= 1")
    bar = _Progress(not args.quiet)
    try:
        try:
            timeline = {
                "timeline_max_steps": args.timeline_steps,
                "timeline_from_s": args.timeline_from_s,
            }
            with output_place(out, RUN_FOLDER, args.force):
                res = replay(
                    cfg, args.trace, out, args.repeat, args.max_seconds, not args.no_warmup, bar,
                    timeline=timeline, probe=not args.no_probe,
                )  # fmt: skip
        finally:
            bar.close()
    except (ConfigError, TraceError, UsageError, FileNotFoundError):
        raise  # bad input: one line, exit 2 (bubblesim.core.cli.run_main)
    except ReplayTimeout as e:
        print(
            f"out of time (--max-seconds {args.max_seconds:g}){_partial(e, out)}", file=sys.stderr
        )
        return 3
    except KeyboardInterrupt as e:
        term = isinstance(e, Terminated)
        print(
            f"{'terminated (SIGTERM)' if term else 'interrupted'}{_partial(e, out)}",
            file=sys.stderr,
        )
        return 143 if term else 130
    except Exception as e:
        print(f"error: engine failed: {type(e).__name__}: {e}{_partial(e, out)}", file=sys.stderr)
        return 1
    print_run_summary(res.summary, out, res.wall_s)
    window = timeline_line(res.summary.get("timeline") or {})
    if window:
        print(f"  {window}")
    if args.repeat > 1:
        sp = res.summary["repeat_spread"]
        for name in ("output_tok_per_s", "tpot_s.p50", "tpot_s.p99", "ttft_s.p50"):
            r = sp[name].get("range_rel")
            print(
                f"  spread {name:<16} {'-' if r is None else f'{100 * r:.2f} %':>9} "
                f"over {args.repeat} repeats"
            )
    if args.profile_kernels:
        from replay.gpu.kernels import profile_kernels  # lazy: only with --profile-kernels

        path = profile_kernels(cfg, args.trace, out.with_name(out.name + ".kernels"))
        print(f"kernel profile -> {path}")
    return 0


# ---- compare ------------------------------------------------------------------------------------
def cmd_compare(args: argparse.Namespace) -> int:
    # lazy: compare needs numpy, never torch
    from bubblesim.core.runfmt import RunFormatError, load_run
    from replay.analysis.compare import CompareError, compare_runs
    from replay.analysis.outdir import FIDELITY_FOLDER
    from replay.analysis.report import print_targets, write_report

    m = Path(args.measured)
    out = Path(args.output or m.with_name(f"fidelity-{m.name}"))
    check_place(out, FIDELITY_FOLDER, args.force)
    try:
        pred, meas = load_run(args.predicted), load_run(args.measured)
        fid = compare_runs(pred, meas, allow_other_trace=args.allow_other_trace)
    except (RunFormatError, CompareError) as e:
        raise UsageError(str(e)) from None
    if fid["sides_warning"]:
        print(f"warning: {fid['sides_warning']}", file=sys.stderr)
    with output_place(out, FIDELITY_FOLDER, args.force), atomic_dir(out, FIDELITY_FOLDER) as tmp:
        (tmp / "fidelity.json").write_text(json.dumps(fid, indent=2, allow_nan=False) + "\n")
        write_report(fid, pred, meas, tmp)
    print_targets(fid, out)
    return 1 if args.strict and not fid["passed"] else 0


# ---- calibrate ----------------------------------------------------------------------------------
def _gpu_terms(items: list[str]) -> dict[str, tuple[str, ...]]:
    from replay.analysis.calibrate import GPU_TERMS  # lazy: numpy, only for calibrate

    out = {}
    for item in items:
        kind, sep, terms = item.partition("=")
        if not sep or kind not in GPU_TERMS:
            raise UsageError(f"--gpu-terms '{item}': expected decode=a,b,... or mixed=a,b,...")
        out[kind] = tuple(t.strip() for t in terms.split(",") if t.strip())
    return out


def cmd_calibrate(args: argparse.Namespace) -> int:
    # lazy: calibrate needs numpy and pyarrow, never torch
    from bubblesim.core.runfmt import RunFormatError, load_run
    from replay.analysis.calibrate import (
        CalibrationError,
        calibrate,
        evaluate,
        print_quality,
        write_calibration,
    )
    from replay.analysis.outdir import PROFILE_FILE

    if not args.output:
        raise UsageError("calibrate: -o PROFILE is required")
    if args.host_states and (args.no_host_speed or args.no_spread or args.host_copula):
        raise UsageError("calibrate: --host-states needs the host speed and the spread fits and "
                         "is not for the copula (drop --no-host-speed / --no-spread / "
                         "--host-copula)")  # fmt: skip
    if args.host_copula and (args.no_host_speed or args.no_spread):
        raise UsageError("calibrate: --host-copula needs the host speed and the spread fits "
                         "(drop --no-host-speed / --no-spread)")  # fmt: skip
    check_place(Path(args.output), PROFILE_FILE, args.force)
    gpu = next((s.partition("=")[2] for s in args.sets if s.partition("=")[0] == "gpu"), None)
    try:
        kinds = tuple(k.strip() for k in args.shapes_kinds.split(",") if k.strip())
        cal = calibrate(
            args.runs,
            _gpu_terms(args.gpu_terms),
            gpu,
            shapes=args.shapes,
            shapes_kinds=kinds,
            gpu_model=args.gpu_model,
            spread=not args.no_spread,
            host_speed=not args.no_host_speed,
            host_copula=args.host_copula,
            host_states=args.host_states,
            idle_sweeps=args.idle_sweep,
            sampling_sweep=args.sampling_sweep,
            envelope=args.envelope,
        )
        checks = {}
        if args.check:
            checks = evaluate(cal.profile, [load_run(d) for d in args.check])
    except (RunFormatError, CalibrationError, ValueError) as e:
        raise UsageError(str(e)) from None
    with output_place(args.output, PROFILE_FILE, args.force):
        side = write_calibration(cal, args.output, checks)
    sweeps = f" + {len(args.shapes)} shape sweep(s)" if args.shapes else ""
    print_quality(f"fit on {len(args.runs)} run(s){sweeps}:", cal.quality)
    if checks:
        print_quality(f"check on {len(args.check)} other run(s):", checks)
    for phase, sp in cal.spread.items():
        print(
            f"cpu_spread.{phase}: measured/predicted over {sp['n']} steps, table p50 "
            f"{sp['p50']:.3f} p99 {sp['p99']:.3f} p99.9 {sp['p999']:.3f} (mean 1; weighted "
            f"mean of the ratios {sp['ratio_weighted_mean']:.3f})"
        )
    for note in cal.notes:
        print(f"note: {note}")
    if cal.verdict:
        print(cal.verdict)
    print(f"profile -> {args.output}  (fit report: {side})")
    return 0


# ---- shapes -------------------------------------------------------------------------------------
def cmd_shapes(args: argparse.Namespace) -> int:
    # lazy: the sweep runs the engine (torch)
    from replay.analysis.outdir import SHAPES_FILE
    from replay.analysis.shapes_grid import FAMILIES
    from replay.gpu.shapes import KINDS, sweep

    cfg = config_from_args(args)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or any(k not in KINDS for k in kinds):
        raise UsageError(f"--kinds '{args.kinds}': expected a comma-separated subset of {KINDS}")
    if args.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    if args.quick < 0:
        raise UsageError("--quick must be >= 0")
    if args.budget_s < 0 or (args.points is not None and args.points < 1):
        raise UsageError("--budget-s must be >= 0 (0: no budget) and --points >= 1")
    if args.max_context < 0:
        raise UsageError("--max-context must be >= 0 (0: max_model_len)")
    families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise UsageError(f"--families: unknown {unknown}; the grid's families are {FAMILIES}")
    batches = None
    if args.batches:
        # lazy, as the sweep: only this command reads a batches file
        from replay.analysis.batches_file import BatchesError, read_batches

        if families:
            raise UsageError("--batches times its own batches: leave --families out")
        try:
            max_len = cfg.max_model_len or get_model(cfg.model).max_context
            batches = read_batches(args.batches, cfg.max_num_seqs, max_len)
        except BatchesError as e:
            raise UsageError(str(e)) from None
    out = Path(args.output or Path("runs") / f"shapes-{Path(cfg.model).name}.parquet")
    bar = _Progress(not args.quiet)
    try:
        try:
            with output_place(out, SHAPES_FILE, args.force):
                res = sweep(
                    cfg, out, args.repeats, kinds, args.quick, args.max_seconds, bar,
                    budget_s=args.budget_s or None, points=args.points,
                    max_context=args.max_context, announce=print, families=families,
                    batches=batches,
                )  # fmt: skip
        finally:
            bar.close()
    except NotImplementedError as e:
        raise ConfigError(f"the engine cannot run this config: {e}") from None
    except ValueError as e:  # the engine names the config key (e.g. device=cuda without CUDA)
        raise ConfigError(str(e)) from None
    m = res.meta
    print(
        f"shapes of {m['model']} on '{m['gpu']}' ({m['dtype']}): "
        + ", ".join(f"{n} {k}" for k, n in res.counts.items())
        + f" in {res.wall_s:.1f} s (GPU busy {res.gpu_busy_s:.1f} s)"
    )
    print(
        f"  samples retried (GPU started before the host was done): {res.unclean_samples}; "
        f"shapes dropped: {res.dropped_shapes}; shapes with wrapped KV blocks: "
        f"{res.wrapped_shapes} (cache {m['num_kv_blocks']} blocks); a request longer than "
        f"the cache: {m['unstaged_shapes']}"
    )
    for kind, env in m["envelope"].items():
        print(
            f"  {kind} envelope: {env['num_reqs'][0]}-{env['num_reqs'][1]} requests, "
            f"{env['num_tokens'][0]}-{env['num_tokens'][1]} tokens, "
            f"{env['kv_per_req'][0]}-{env['kv_per_req'][1]} KV tokens per request"
        )
    if not res.complete:
        why = {
            "max_seconds": f"after --max-seconds {args.max_seconds:g}",
            "SIGTERM": "by SIGTERM",
            "interrupted": "by Ctrl-C",
        }.get(m["stopped"], "early")
        print(f"  stopped {why}: {res.rows} of {m['shapes']} shapes (file complete: false)")
    print(f"shapes -> {res.path}")
    return {"SIGTERM": 143, "interrupted": 130}.get(m["stopped"], 0) if not res.complete else 0


# ---- idlegap ------------------------------------------------------------------------------------
def cmd_idlegap(args: argparse.Namespace) -> int:
    # lazy: the sweep runs the engine (torch)
    from replay.analysis.idlegap_file import fit_idle_sweep
    from replay.analysis.outdir import IDLEGAP_FILE
    from replay.gpu.idlegap import sweep_idle

    cfg = config_from_args(args)
    gaps = _float_list(args.gaps, "--gaps")
    if not gaps or min(gaps) < 0:
        raise UsageError("--gaps: expected a comma-separated list of ms >= 0")
    if args.repeats < 1 or args.shapes < 1:
        raise UsageError("--repeats and --shapes must be >= 1")
    out = Path(args.output or Path("runs") / f"idlegap-{Path(cfg.model).name}.parquet")
    bar = _Progress(not args.quiet)
    try:
        try:
            with output_place(out, IDLEGAP_FILE, args.force):
                res = sweep_idle(cfg, out, gaps, args.repeats, args.shapes, args.max_seconds, bar)
        finally:
            bar.close()
    except NotImplementedError as e:
        raise ConfigError(f"the engine cannot run this config: {e}") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(
        f"idle gaps of {res.meta['model']} on '{res.meta['gpu']}': {res.samples} samples over "
        f"{res.shapes} decode shapes in {res.wall_s:.1f} s (shapes dropped: {res.dropped_shapes})"
    )
    _, report = fit_idle_sweep([res.path])
    for kind, r in report.items():
        if "shrink_per_ms" not in r:
            print(f"  {kind}: {r['note']}")
            continue
        print(
            f"  {kind} law: saves min({r['shrink_per_ms']:.2f} x (idle - "
            f"{r['shrink_after_ms']:.3f} ms), {r['shrink_max_fraction']:.2f} x pass); median "
            f"|error| {r['abs_err_ms_law']:.3f} ms (none {r['abs_err_ms_none']:.3f} ms)"
        )
        for lo, hi, n, saved, frac in r["saved_ms_by_gap"]:
            print(f"    idle {lo:g}-{hi:g} ms: {n} samples, saved {saved:.3f} ms ({frac:.1%})")
    print(f"idle gaps -> {res.path}")
    return 0


# ---- sampling -----------------------------------------------------------------------------------
def cmd_sampling(args: argparse.Namespace) -> int:
    # lazy: the sweep runs the engine's sampler (torch)
    from replay.analysis.outdir import SAMPLING_FILE
    from replay.analysis.sampling_file import describe, fit_sampling, hot_and_cold
    from replay.gpu.sampling import sweep_sampling

    cfg = config_from_args(args)
    if args.repeats < 1 or args.max_rows < 1:
        raise UsageError("--repeats and --max-rows must be >= 1")
    out = Path(args.output or Path("runs") / f"sampling-{Path(cfg.model).name}.parquet")
    bar = _Progress(not args.quiet)
    try:
        try:
            with output_place(out, SAMPLING_FILE, args.force):
                res = sweep_sampling(cfg, out, args.max_rows, args.repeats, bar)
        finally:
            bar.close()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(
        f"sampling modes of {res.meta['model']} on '{res.meta['gpu']}': {len(res.rows)} "
        f"timings in {res.wall_s:.1f} s"
    )
    print("\n".join(describe(fit_sampling(res.path))))
    print("\n".join(hot_and_cold(res.path)))
    print(f"sampling sweep -> {res.path}")
    return 0


def _float_list(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} '{text}': expected comma-separated numbers") from None


# ---- ablate -------------------------------------------------------------------------------------
def cmd_ablate(args: argparse.Namespace) -> int:
    # lazy: ablate runs the engine (torch)
    from replay.analysis.outdir import ABLATE_FOLDER
    from replay.gpu.ablate import ablate, parse_switches, print_table

    cfg = config_from_args(args)
    switches = parse_switches(args.switches)
    out = Path(args.output or Path("runs") / f"ablate-{Path(args.trace).stem}")
    bar = _Progress(not args.quiet)
    try:
        with output_place(out, ABLATE_FOLDER, args.force):
            result = ablate(
                cfg,
                args.trace,
                out,
                switches,
                args.repeat,
                not args.no_measure,
                not args.no_predict,
                args.max_seconds,
                bar,
                Path(args.measured) if args.measured else None,
                args.calibrate_on,
                [Path(d) for d in args.calibrate_also],
                not args.no_interleave,
            )
    finally:
        bar.close()
    print_table(result)
    print(f"ablation -> {out / 'ablate.json'}")
    return 0


# ---- allreduce, allreduce-fit -------------------------------------------------------------------
def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} '{text}': expected comma-separated integers") from None
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{flag} '{text}': expected integers >= 1")
    return vals


def cmd_allreduce(args: argparse.Namespace) -> int:
    # lazy: the sweep spawns torch processes
    from replay.gpu.nccl_sweep import DTYPES, MODES, sizes_between, sweep

    gpus = _int_list(args.gpus, "--gpus")
    if args.backend == "nccl" and any(n < 2 for n in gpus):
        raise UsageError(f"--gpus '{args.gpus}': an all-reduce needs 2 or more GPUs")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes):
        raise UsageError(f"--modes '{args.modes}': expected a comma-separated subset of {MODES}")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype '{args.dtype}': expected one of {sorted(DTYPES)}")
    if args.samples < 1 or not 1 <= args.min_bytes <= args.max_bytes:
        raise UsageError("--samples must be >= 1 and 1 <= --min-bytes <= --max-bytes")
    out = Path(args.output or Path("runs") / "allreduce.parquet")
    check_place(out, _ALLREDUCE_FILE, args.force)
    try:
        res = sweep(
            out, gpus, sizes_between(args.min_bytes, args.max_bytes), args.samples, modes,
            args.dtype, args.backend, args.gpu,
        )  # fmt: skip
    except ValueError as e:
        raise UsageError(str(e)) from None
    for note in res.notes:
        print(f"note: {note}")
    for r in res.rows:
        moved = 2 * (r["world_size"] - 1) / r["world_size"] * r["bytes"]
        busbw = moved / (r["ms"] / 1e3) / 1e9
        print(
            f"  {r['mode']:<5} n={r['world_size']} {r['bytes']:>11} B  {1e3 * r['ms']:9.2f} us"
            f"  busbw {busbw:7.1f} GB/s"
        )
    print(f"{len(res.rows)} rows in {res.wall_s:.1f} s -> {res.path}")
    return 0


def cmd_allreduce_fit(args: argparse.Namespace) -> int:
    # lazy: the fit needs numpy and pyarrow, never torch
    from replay.analysis.allreducefit import (
        SMALL_KERNEL_MODES,
        SweepFileError,
        fit_profile,
        fit_sweep,
        fit_sweep_oneshot,
        has_mode,
        read_sweep,
    )
    from sim.cost import save_profile

    try:
        sw = read_sweep(args.sweep)
        small = [m for m in SMALL_KERNEL_MODES if has_mode(sw, m)]
        # a sweep of one-kernel modes only fits only their keys; else the NCCL rows as before
        nccl = has_mode(sw, args.mode) or not small
        res = fit_sweep(sw, args.mode, args.gpu) if nccl else None
        kernels = {m: fit_sweep_oneshot(sw, args.gpu, m) for m in small}
    except SweepFileError as e:
        raise UsageError(str(e)) from None
    prof = fit_profile(
        sw, res, args.mode, str(args.sweep), kernels.get("oneshot"), kernels.get("fused")
    )
    if prof["gpu"] is None:
        del prof["gpu"]
    out = Path(args.output or Path(args.sweep).with_suffix(".profile.json"))
    save_profile(out, prof)
    if res is None:
        print(f"note: no '{args.mode}' rows: gpu_pass.allreduce not fitted")
    else:
        p = res.params
        print(
            f"gpu_pass.allreduce: latency_ms {p['latency_ms']:.5f} + latency_ms_per_peer "
            f"{p['latency_ms_per_peer']:.5f} x (n - 1), bw_efficiency {p['bw_efficiency']:.3f} "
            f"({res.rows} rows, world sizes {res.world_sizes}; relative error rms "
            f"{100 * res.rms_rel:.1f} %, max {100 * res.max_rel:.1f} %)"
        )
        for note in res.notes:
            print(f"note: {note}")
    for m, one in kernels.items():
        p = one.params
        moved = "read" if m == "oneshot" else "pushed"
        print(
            f"gpu_pass.allreduce_{m}: latency_ms {p['latency_ms']:.5f} + (n - 1) x bytes "
            f"{moved}, bw_efficiency {p['bw_efficiency']:.3f} ({one.rows} rows within the "
            f"{m} limits, world sizes {one.world_sizes}; relative error rms "
            f"{100 * one.rms_rel:.1f} %, max {100 * one.max_rel:.1f} %)"
        )
        for note in one.notes:
            print(f"note: {note}")
    print(f"profile -> {out}")
    return 0


def _is_allreduce(p: Path) -> bool:
    # lazy: pyarrow only when a file is classified
    import pyarrow.parquet as pq

    from replay.analysis.allreducefit import META_KEY  # lazy: numpy, with pyarrow

    try:
        return META_KEY in (pq.read_schema(p).metadata or {})
    except Exception:  # noqa: BLE001 - not parquet at all
        return False


_ALLREDUCE_FILE = OutKind("all-reduce sweep", folder=False, recognise=_is_allreduce)


def cmd_probe(args: argparse.Namespace) -> int:
    # lazy, as every command's: `--help` and the other commands skip torch
    from replay.analysis.probe import host_scale, probe_level
    from replay.gpu.run import probe_host
    from sim.cost.profile import load_profile, resolve_profile

    cfg = config_from_args(args)
    out = Path(args.output or Path("runs") / "probe")
    profile = load_profile(args.against) if args.against else None  # bad input: before
    with output_place(out, RUN_FOLDER, args.force):
        summary = probe_host(cfg, out)
    print(f"host probe -> {out}  ({summary['num_steps']} steps)")
    if profile is not None:
        level = probe_level(out, resolve_profile(profile))
        print(f"  level against {args.against}: {level:.3f}")
        if "host_probe" in profile:
            print(f"  host_scale={host_scale(out, args.against):.3f}")
    return 0


def build_parser(prog: str = "python -m replay") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "run", help="a measured run of a trace on the engine: a run folder like `sim run`'s"
    )
    p.add_argument("trace", help="trace parquet file")
    add_config_args(p)
    p.add_argument("--repeat", type=int, default=1, help="run N times; report the spread")
    p.add_argument("--max-seconds", type=float, help="stop after this long (partial run)")
    p.add_argument(
        "--profile-kernels",
        action="store_true",
        help="an extra run under torch.profiler -> DIR.kernels/",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up requests")
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="skip the host probe served before the run (its folder DIR/probe/: the host's "
        "level, replay.analysis.probe)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    add_timeline_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "probe",
        help="the host probe alone: this host's CPU level, and with --against PROFILE the "
        "host_scale that carries the profile here",
    )
    add_config_args(p)
    p.add_argument("--against", metavar="PROFILE", help="a profile with `host_probe`")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("compare", help="fidelity of a predicted run against a measured one")
    p.add_argument("predicted", help="predicted run folder (python -m sim run)")
    p.add_argument("measured", help="measured run folder (python -m replay run)")
    add_config_args(p)
    p.add_argument(
        "--allow-other-trace",
        action="store_true",
        help="compare runs of different traces (metrics only make sense loosely)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("calibrate", help="fit the simulator's cost profile from measured runs")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="measured run folders")
    add_config_args(p)
    p.add_argument(
        "--check",
        nargs="+",
        default=[],
        metavar="RUN_DIR",
        help="other runs to check the fitted profile on",
    )
    p.add_argument(
        "--gpu-terms",
        action="append",
        default=[],
        metavar="KIND=T1,T2",
        help="GPU pass regressors of one batch kind, e.g. decode=intercept,num_tokens (default "
        "decode: intercept, num_tokens, kv_read_tokens, num_reqs; mixed: those and "
        "max_kv_tokens, attn_pairs, num_prefill_reqs)",
    )
    p.add_argument(
        "--shapes",
        action="append",
        default=[],
        metavar="FILE",
        help="a `replay shapes` sweep whose rows join the GPU pass fits (repeatable)",
    )
    p.add_argument(
        "--shapes-kinds",
        default="mixed",
        metavar="KINDS",
        help="batch kinds whose sweep rows join the fits (default mixed: the sweep's decode "
        "graphs hold no input copy or sampling, which a run's decode interval does); the "
        "others are only reported",
    )
    p.add_argument(
        "--gpu-model",
        default="auto",
        choices=("auto", "linear", "piecewise"),
        help="GPU pass form: piecewise = a decode table and a mixed-step spline fitted on the "
        "sweep, with held-back points checked; linear = one linear fit per kind (+ the decode "
        "straggler branch); auto (default) = piecewise for sweeps that measure whole steps",
    )
    p.add_argument(
        "--no-spread",
        action="store_true",
        help="leave out the CPU phases' measured spread (profile key cpu_spread): every step "
        "then takes the linear models' time",
    )
    p.add_argument(
        "--idle-sweep",
        action="append",
        default=[],
        metavar="FILE",
        help="a `replay idlegap` sweep: the idle-start law it gives replaces the runs' "
        "(repeatable; a spec-decoding sweep gives the verify law)",
    )
    p.add_argument(
        "--sampling-sweep",
        metavar="FILE",
        help="a `replay sampling` sweep: random sampling's cost over greedy (profile key "
        "sampling; without it the profile takes the built-in table)",
    )
    p.add_argument(
        "--envelope",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="a run that joins only the CPU phase fits, levelled to the runs' host: the phases' "
        "shape over batch sizes the runs never reach (traces/fidelity/ramp.parquet run with "
        "arrival=asap; repeatable; profile key envelope_runs)",
    )
    p.add_argument(
        "--no-host-speed",
        action="store_true",
        help="leave out the host's slowly varying speed (profile key host_speed): the CPU "
        "phases then vary step by step only, by cpu_spread",
    )
    p.add_argument(
        "--host-copula",
        action="store_true",
        help="also fit host_speed.rho: the simulator then draws each CPU phase from its "
        "measured cpu_spread table at a quantile correlated with the host's state (a Gaussian "
        "copula) instead of the host speed x the spread around it",
    )
    p.add_argument(
        "--host-states",
        action="store_true",
        help="fit the host's speed as two states (fast, and slow_over_fast x slower) it "
        "switches between, with the processes' wander within them (host_speed.states)",
    )
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser(
        "shapes", help="clean GPU timings of synthetic batches (for calibrate --shapes)"
    )
    add_config_args(p)
    p.add_argument("--repeats", type=int, default=5, help="clean samples per shape (median)")
    p.add_argument("--kinds", default="mixed,decode", help="batch kinds to sweep")
    p.add_argument(
        "--families",
        default="",
        help="only these grid families, comma-separated (their sweep `label`, e.g. "
        "'chunks(uneven),chunks@ctx'; default: all but the opt-in ones): a sweep to add to "
        "another with calibrate --shapes A --shapes B; the opt-in 'decode(mix),decode(mix "
        "desc)': decode batches of spread contexts beside uniform ones, shuffled and longest "
        "first (how much of the decode tail term each graph bucket hides)",
    )
    p.add_argument(
        "--batches",
        default="",
        help='time these decode batches instead of the grid: a JSON file {"format": '
        '"replay.batches", "version": 1, "batches": [{"label": L, "contexts": '
        "[keys each row reads, in row order]}, ...]}; each row of the sweep file carries its "
        "batch's label",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="estimated GPU seconds the grid may take, coarse points first (0: the whole grid)",
    )
    p.add_argument("--points", type=int, help="at most this many shapes, coarse points first")
    p.add_argument(
        "--max-context",
        type=int,
        default=0,
        help="longest context per request swept (default 0: max_model_len)",
    )
    p.add_argument("--quick", type=int, default=0, metavar="N", help="about N shapes per kind")
    p.add_argument("--max-seconds", type=float, help="stop adding shapes after this long")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_shapes)

    p = sub.add_parser(
        "idlegap", help="decode graphs timed after set GPU idle gaps (calibrate --idle-sweep)"
    )
    add_config_args(p)
    p.add_argument("--gaps", default="0.05,0.1,0.2,0.3,0.5,0.75,1,1.5,2,3", help="host waits, ms")
    p.add_argument("--repeats", type=int, default=5, help="samples per shape and gap")
    p.add_argument("--shapes", type=int, default=12, help="about this many decode shapes")
    p.add_argument("--max-seconds", type=float, help="stop adding shapes after this long")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_idlegap)

    p = sub.add_parser(
        "sampling",
        help="each random sampling mode timed against greedy, per sampled row (calibrate "
        "--sampling-sweep)",
    )
    add_config_args(p)
    p.add_argument("--max-rows", type=int, default=1024, help="most rows sampled at once")
    p.add_argument("--repeats", type=int, default=15, help="timings per point (median)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_sampling)

    p = sub.add_parser("ablate", help="each seed switch off/on: measured beside predicted")
    p.add_argument("trace", help="trace parquet file")
    add_config_args(p)
    p.add_argument("--switches", help="comma-separated switches (default: the five seeds)")
    p.add_argument("--repeat", type=int, default=3, help="measured repeats per side")
    p.add_argument("--max-seconds", type=float, help="limit per measured run")
    p.add_argument("--no-measure", action="store_true", help="predictions only (no engine)")
    p.add_argument("--no-predict", action="store_true", help="measurements only (no sim)")
    p.add_argument(
        "--no-interleave",
        action="store_true",
        help="measure all off repeats, then all on (default: the sides take turns, so host "
        "drift over the call hits both)",
    )
    p.add_argument(
        "--measured",
        metavar="DIR",
        help="take the measured runs from an earlier ablation's folder (DIR/<switch>-off, -on) "
        "instead of running the engine",
    )
    p.add_argument(
        "--calibrate-on",
        choices=("off", "on"),
        help="fit the sim's profile on this side's measured run (over --set profile=, if any) "
        "and predict both sides with it: the other side is out of sample",
    )
    p.add_argument(
        "--calibrate-also",
        nargs="+",
        default=[],
        metavar="RUN_DIR",
        help="more measured runs for that fit (other traces; never the other side)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_ablate)

    p = sub.add_parser(
        "allreduce", help="time torch.distributed all_reduce on N local GPUs (NCCL sweep)"
    )
    p.add_argument("--gpus", default="2", help="world sizes, comma-separated (default 2)")
    p.add_argument("--min-bytes", type=int, default=1024, help="smallest message (default 1 KiB)")
    p.add_argument(
        "--max-bytes", type=int, default=256 * 2**20, help="largest message (default 256 MiB)"
    )
    p.add_argument("--samples", type=int, default=20, help="timed samples per size (median)")
    p.add_argument(
        "--modes",
        default="graph,eager,oneshot",
        help="graph, eager, oneshot and/or fused calls (the CPU: eager only; oneshot and "
        "fused each exchange symmetric memory)",
    )
    p.add_argument("--dtype", default="bfloat16", help="element type (default bfloat16)")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"), help="gloo: CPU test")
    p.add_argument(
        "--gpu", help="bubblesim.core.gpus preset the file names (default: from the device)"
    )
    p.add_argument("-o", "--output", help="parquet file (default runs/allreduce.parquet)")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.set_defaults(func=cmd_allreduce)

    p = sub.add_parser(
        "allreduce-fit",
        help="fit the sim's gpu_pass.allreduce keys (allreduce_oneshot, allreduce_fused from "
        "'oneshot', 'fused' rows) "
        "from an all-reduce sweep",
    )
    p.add_argument("sweep", help="a `replay allreduce` parquet file")
    p.add_argument(
        "--mode",
        default="graph",
        choices=("graph", "eager"),
        help="NCCL rows to fit (a sweep's 'oneshot' / 'fused' rows always fit their key)",
    )
    p.add_argument("--gpu", help="bubblesim.core.gpus preset (default: the sweep's)")
    p.add_argument("-o", "--output", help="profile JSON (default SWEEP.profile.json)")
    p.set_defaults(func=cmd_allreduce_fit)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m replay") -> int:
    args = build_parser(prog).parse_args(argv)
    return int(args.func(args) or 0)


def console() -> int:
    """The `bubblesim-replay` console script (pyproject.toml [project.scripts])."""
    return run_main(lambda argv: main(argv, prog="bubblesim-replay"))


if __name__ == "__main__":
    sys.exit(run_main(main))
