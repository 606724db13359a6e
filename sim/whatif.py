"""`python -m sim whatif TRACE`: each seed switch, the async depth, the spec method and the GC
settings flipped alone against one baseline config.

Every variant is one predicted run of the same trace. Runs go to a local process pool; results
are keyed by variant and written in a fixed variant order, so `whatif.json` is the same
bytes whatever the pool size or completion order. Variants whose config equals the baseline's
(or an earlier variant's) reuse that run. Output, in `-o DIR`:

  whatif.json       {variant: {metric: {"baseline": x, "variant": y}}}   (None = n/a)
  whatif-info.json  trace, baseline config, and per variant: its overrides, the run it shares,
                    and a note when the switch cannot act under this baseline
  runs/<variant>/   each variant's run folder (as `sim run` writes it), with --keep-runs only
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bubblesim.core.atomic import replacing
from bubblesim.core.cli import (
    UsageError,
    add_config_args,
    finished,
    run_main,
    sigterm_deferred,
)
from bubblesim.core.config import SPEC_METHODS, Config
from bubblesim.core.outplace import OutKind, atomic_dir, output_place
from bubblesim.core.runfmt import CAUSES, trace_info
from bubblesim.core.scenario import Scenario
from bubblesim.core.switches import SWITCHES, Switch, cannot_act, value_of
from sim.cli import add_scenario_arg, trace_config
from sim.cost.sampling import GREEDY, MODES

BASELINE = "baseline"


# ---- variants -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    name: str
    what: str  # one line for --help and the table
    overrides: Callable[[Config], dict[str, Any]]  # dotted key -> value, from the baseline
    inert: Callable[[Config, bool], str | None]  # (baseline, trace has history) -> why no effect


def _flip(key: str) -> Callable[[Config], dict[str, Any]]:
    return lambda c: {key: not c.flat()[key]}


def _set(key: str, value: Any) -> Callable[[Config], dict[str, Any]]:
    return lambda c: {key: value}


def _switch_variant(sw: Switch) -> Variant:
    """A registry switch (bubblesim.core.switches) moved to its other side; a baseline on neither
    side (seed 4
    with spec.method=none) is left as it is, and the switch's note says why."""

    def overrides(c: Config) -> dict[str, Any]:
        other = {sw.before: sw.after, sw.after: sw.before}
        now = value_of(c, sw.key)
        return {sw.key: other[now]} if now in other else {}

    def inert(c: Config, history: bool) -> str | None:
        return cannot_act(sw, c, history)

    flipped = isinstance(sw.before, bool)
    what = f"{sw.models} flipped" if flipped else f"{sw.models}: {sw.before} <-> {sw.after}"
    return Variant(sw.name, what, overrides, inert)


def _always(c: Config, history: bool) -> str | None:
    return None


def _needs_gc(c: Config, history: bool) -> str | None:
    return None if c.gc.model else "the GC model is off (gc.model=false)"


def _sampling_variant(mode: str) -> Variant:
    """Requests sampled in `mode` (greedy or one of sim.cost.sampling.MODES, at the parameters
    the sampling sweep times it with); the penalties stay the baseline's."""
    params: dict[str, Any] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, **MODES.get(mode, {})}
    shown = ", ".join(f"{k} {v:g}" for k, v in params.items() if k != "top_k" or v)
    what = "greedy sampling (temperature 0)" if mode == GREEDY else f"sampling {mode}: {shown}"

    def inert(c: Config, history: bool) -> str | None:
        now = c.sampling
        same = (now.temperature, now.top_k, now.top_p) == tuple(params.values())
        return "the baseline samples so already" if same else None

    return Variant(
        f"sampling={mode}", what, lambda c: {f"sampling.{k}": v for k, v in params.items()}, inert
    )


# seeds first, the other switches after the depth and spec-method variants (whatif.json order)
VARIANTS: tuple[Variant, ...] = (
    *(_switch_variant(sw) for sw in SWITCHES if sw.seed is not None),
    *(
        Variant(f"batches_in_flight={n}", f"async depth {n}", _set("batches_in_flight", n), _always)
        for n in (1, 2, 3)
    ),
    *(
        Variant(f"spec.method={m}", f"speculative decoding: {m}", _set("spec.method", m), _always)
        for m in SPEC_METHODS
    ),
    # how requests are sampled: greedy, or at random (sim.cost.sampling's measured cost)
    *(_sampling_variant(m) for m in (GREEDY, "random", "top_k", "top_p")),
    *(_switch_variant(sw) for sw in SWITCHES if sw.seed is None),
    Variant("gc_freeze", "gc.freeze() after start-up flipped", _flip("gc_freeze"), _needs_gc),
    Variant("gc.model", "GC pauses modelled at all, flipped", _flip("gc.model"), _always),
    # the host itself: every CPU phase x host_scale (a faster or slower CPU, or a host whose
    # level sits elsewhere; one host moved by up to 1.75x between runs, reports/fidelity)
    *(
        Variant(
            f"host_scale={x}", f"every CPU phase x {x} (the host)", _set("host_scale", x), _always
        )
        for x in (0.5, 1.5)
    ),  # fmt: skip
)
VARIANT_NAMES: tuple[str, ...] = tuple(v.name for v in VARIANTS)
_BY_NAME = {v.name: v for v in VARIANTS}


def select_variants(text: str | None) -> list[Variant]:
    """`--variants a,b` -> those variants in canonical order; None = all."""
    if text is None:
        return list(VARIANTS)
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise UsageError("--variants: empty list; choose from " + ", ".join(VARIANT_NAMES))
    for n in names:
        if n not in _BY_NAME:
            raise UsageError(
                f"--variants: unknown variant '{n}'; choose from " + ", ".join(VARIANT_NAMES)
            )
    return [v for v in VARIANTS if v.name in names]


# ---- metrics --------------------------------------------------------------------------------
# metric name -> path into summary.json (Contract 3)
METRIC_PATHS: dict[str, tuple[str, ...]] = {
    "output_tok_per_s": ("output_tok_per_s",),
    "req_per_s": ("req_per_s",),
    **{
        f"{d}.{q}": (d, q)
        for d in ("tpot_s", "ttft_s", "itl_s", "e2e_s")
        for q in ("p50", "p99", "mean")
    },
    "bubble_fraction": ("bubble_fraction",),
    "gpu_busy_fraction": ("gpu_busy_fraction",),
    "bubble_s": ("bubble_s",),
    **{f"bubble_s_by_cause.{c}": ("bubble_s_by_cause", c) for c in CAUSES},
    "gc_pause_s": ("gc", "total_s"),
    "gc_count": ("gc", "count"),
    "num_steps": ("num_steps",),
    "span_s": ("span_s",),
    "accepted_draft_tokens": ("accepted_draft_tokens",),
}
METRICS: tuple[str, ...] = tuple(METRIC_PATHS)


def metrics_of(summary: dict[str, Any]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {}
    for name, path in METRIC_PATHS.items():
        node: Any = summary
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        out[name] = node if isinstance(node, int | float) else None
    return out


def rel_change(base: float | None, new: float | None) -> float | None:
    if base is None or new is None or base == 0:
        return None
    return (new - base) / base


# ---- planning -------------------------------------------------------------------------------
@dataclass
class Plan:
    """Which runs to make: `runs` name -> config (unique configs), `uses` variant -> run name."""

    baseline: Config
    variants: list[Variant]
    runs: dict[str, Config]
    uses: dict[str, str]
    overrides: dict[str, dict[str, Any]]
    notes: dict[str, str | None]


def make_plan(base: Config, variants: list[Variant], history: bool) -> Plan:
    runs: dict[str, Config] = {BASELINE: base}
    seen = {_key(base): BASELINE}
    uses: dict[str, str] = {}
    overrides: dict[str, dict[str, Any]] = {}
    notes: dict[str, str | None] = {}
    for v in variants:
        over = v.overrides(base)
        cfg = base.replace(**over) if over else base
        overrides[v.name] = over
        same = {k: x for k, x in over.items() if base.flat()[k] != x}
        notes[v.name] = v.inert(base, history) or (None if same else "same as the baseline")
        key = _key(cfg)
        if key not in seen:
            seen[key] = v.name
            runs[v.name] = cfg
        uses[v.name] = seen[key]
    return Plan(base, variants, runs, uses, overrides, notes)


def _key(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)


def preflight(cfg: Config, trace_path: str) -> bool:
    """Refuse a bad trace or config before any run starts (one line); True if the trace has
    needs_history requests. Whether the KV cache holds each request is left to the runs
    (`simulate` checks it first thing, and a refusal there stops the whole what-if)."""
    from bubblesim.core.models import get_model, with_context
    from bubblesim.core.trace import read_trace

    if not Path(trace_path).is_file():
        raise UsageError(f"trace '{trace_path}' does not exist")
    check_config(cfg)
    trace = read_trace(trace_path, with_context(get_model(cfg.model), cfg.max_model_len))
    return bool(trace.history_mask().any())


def check_config(cfg: Config) -> None:
    """The model, GPU and cost profile a config names exist and load."""
    from bubblesim.core.gpus import get_gpu
    from bubblesim.core.models import get_model
    from sim.cost import load_cost_model

    try:
        get_model(cfg.model)
        get_gpu(cfg.gpu)
        load_cost_model(cfg)
    except ValueError as e:  # unknown model or GPU name; ConfigError is a ValueError too
        raise UsageError(str(e)) from None


# ---- running --------------------------------------------------------------------------------
def run_one(
    cfg: Config,
    trace_path: str,
    run_dir: str,
    steps: bool = True,
    scenario: Scenario | None = None,
) -> tuple[dict[str, Any], float]:
    """One predicted run (in a pool worker): its metrics and wall seconds; `steps=False`
    leaves the step records out of its folder (only --keep-runs keeps the folders)."""
    from sim.run import simulate

    t0 = time.perf_counter()
    res = simulate(cfg, trace_path, run_dir, steps=steps, scenario=scenario)
    return metrics_of(res.summary), time.perf_counter() - t0


def run_plan(
    plan: Plan,
    trace_path: str,
    tmp: Path,
    jobs: int,
    log: Callable[[str], None],
    steps: bool = True,
    scenario: Scenario | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every planned config on a pool of `jobs` processes; metrics by run name (the run
    folders with step records if `steps`, recording the `scenario` the baseline came from)."""
    out: dict[str, dict[str, Any]] = {}
    names = list(plan.runs)
    t0 = time.monotonic()
    workers = max(1, min(jobs, len(names)))

    def each(i: int, result: tuple[dict[str, Any], float]) -> None:
        metrics, wall_s = result
        out[names[i]] = metrics
        log(_progress_line(names[i], wall_s, len(out), len(names), time.monotonic() - t0))

    with ProcessPoolExecutor(max_workers=workers) as pool:
        try:
            with sigterm_deferred():  # a submit holds the pool's lock: SIGTERM waits for finished
                futs = [
                    pool.submit(run_one, plan.runs[n], trace_path, str(tmp / n), steps, scenario)
                    for n in names
                ]
            finished(futs, each)
        except BaseException:
            pool.shutdown(cancel_futures=True)  # runs already started still finish
            raise
    return out


def _progress_line(name: str, wall_s: float, done: int, total: int, elapsed_s: float) -> str:
    """One line per finished run; time left assumes the runs left take as long as those done."""
    left = f", ~{elapsed_s * (total - done) / done:.0f} s left" if done < total else ""
    return (
        f"[{done}/{total}] {name}: {wall_s:.1f} s ({100 * done / total:.0f} %, "
        f"{elapsed_s:.0f} s elapsed{left})"
    )


def assemble(plan: Plan, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base = results[BASELINE]
    return {
        v.name: {
            m: {"baseline": base[m], "variant": results[plan.uses[v.name]][m]} for m in METRICS
        }
        for v in plan.variants
    }


def info(plan: Plan, trace_path: str, scenario: Scenario | None = None) -> dict[str, Any]:
    out = {
        "trace": trace_info(trace_path),
        "baseline": plan.baseline.to_dict(),
        "metrics": list(METRICS),
        "variants": {
            v.name: {
                "what": v.what,
                "overrides": plan.overrides[v.name],
                "run": plan.uses[v.name],
                "note": plan.notes[v.name],
            }
            for v in plan.variants
        },
    }
    if scenario is not None:  # the trace's own keys under the baseline (bubblesim.core.scenario)
        out["scenario"] = scenario.flat()
    return out


def write_json(path: Path, data: Any) -> None:
    with replacing(path) as tmp, tmp.open("w") as f:
        json.dump(data, f, indent=2, allow_nan=False)
        f.write("\n")


def keep_runs(plan: Plan, tmp: Path, out: Path) -> None:
    """Move run folders to out/runs/<variant> (a shared run is copied to each variant)."""
    runs = out / "runs"
    runs.mkdir(exist_ok=True)
    for name in [BASELINE, *(v.name for v in plan.variants)]:
        src = tmp / plan.uses.get(name, name)
        dst = runs / name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)


# ---- presentation ---------------------------------------------------------------------------
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("tok/s", "output_tok_per_s"),
    ("TPOT mean", "tpot_s.mean"),
    ("TPOT p99", "tpot_s.p99"),
    ("TTFT p99", "ttft_s.p99"),
    ("ITL p99", "itl_s.p99"),
)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _abs(metric: str, x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if metric == "output_tok_per_s" else f"{x * 1e3:.2f}ms"


def _change_text(over: dict[str, Any]) -> str:
    if not over:
        return "(no change)"
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in over.items())


def table(result: dict[str, Any], inf: dict[str, Any]) -> list[str]:
    """Rows: the baseline's absolute values, then each variant's relative change."""
    head = f"{'variant':<28} {'change':<34}" + "".join(f"{c:>11}" for c, _ in TABLE_COLUMNS)
    head += f"{'bubbles':>16}"
    lines = [head, "-" * len(head)]
    first = next(iter(result.values()), None)
    if first is not None:
        cells = "".join(f"{_abs(m, first[m]['baseline']):>11}" for _, m in TABLE_COLUMNS)
        bub = first["bubble_fraction"]["baseline"]
        lines.append(f"{BASELINE:<28} {'':<34}{cells}{_frac(bub):>16}")
    for name, ms in result.items():
        cells = "".join(
            f"{_pct(rel_change(ms[m]['baseline'], ms[m]['variant'])):>11}" for _, m in TABLE_COLUMNS
        )
        b, v = ms["bubble_fraction"]["baseline"], ms["bubble_fraction"]["variant"]
        change = _change_text(inf["variants"][name]["overrides"])
        lines.append(f"{name:<28} {change[:34]:<34}{cells}{_frac(b) + '->' + _frac(v):>16}")
    return lines


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def summary_lines(result: dict[str, Any], inf: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for label, metric in (("throughput", "output_tok_per_s"), ("P99 TPOT", "tpot_s.p99")):
        changes = [
            (n, rel_change(ms[metric]["baseline"], ms[metric]["variant"]))
            for n, ms in result.items()
        ]
        known = [(n, c) for n, c in changes if c is not None]
        if known:
            n, c = max(known, key=lambda nc: abs(nc[1]))
            out.append(
                f"largest {label} change: {n} ({_change_text(inf['variants'][n]['overrides'])})"
                f" {_pct(c)}"
            )
    flat = [
        n
        for n, ms in result.items()
        if all(
            abs(rel_change(ms[m]["baseline"], ms[m]["variant"]) or 0.0) < 0.005
            for _, m in TABLE_COLUMNS
        )
    ]
    if flat:
        out.append("no effect above 0.5% on the table's metrics: " + ", ".join(flat))
    inert = [f"{n} ({v['note']})" for n, v in inf["variants"].items() if v["note"]]
    if inert:
        out.append("cannot act under this baseline: " + "; ".join(inert))
    return out


# ---- command --------------------------------------------------------------------------------
def add_whatif_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "whatif",
        help="each seed switch, async depth, spec method and GC setting flipped alone",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="trace parquet file")
    add_config_args(p)
    p.add_argument(
        "--variants",
        metavar="A,B,...",
        help="only these variants (default: all): " + ", ".join(VARIANT_NAMES),
    )
    p.add_argument("--jobs", type=int, default=2, metavar="N", help="worker processes (2)")
    p.add_argument("--keep-runs", action="store_true", help="keep run folders in DIR/runs/")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    add_scenario_arg(p)
    p.set_defaults(func=cmd_whatif)


WHATIF_FOLDER = OutKind("what-if folder", folder=True, markers=("whatif.json", "whatif-info.json"))


def cmd_whatif(args: argparse.Namespace) -> int:
    variants = select_variants(args.variants)
    if args.jobs < 1:
        raise UsageError(f"--jobs: must be >= 1, got {args.jobs}")
    base, scenario = trace_config(args)
    out = Path(args.output or Path("runs") / f"whatif-{Path(args.trace).stem}")
    with output_place(out, WHATIF_FOLDER, args.force):
        history = preflight(base, args.trace)
        plan = make_plan(base, variants, history)
        for cfg in plan.runs.values():
            check_config(cfg)

        def log(msg: str) -> None:
            if not args.quiet:
                print(msg, file=sys.stderr, flush=True)

        log(
            f"whatif {args.trace}: {len(plan.variants)} variants, {len(plan.runs)} runs "
            f"on {min(args.jobs, len(plan.runs))} workers"
        )
        with atomic_dir(out, WHATIF_FOLDER) as tmp:  # the folder is replaced whole, or not
            work = tmp / ".runs"
            work.mkdir()
            results = run_plan(plan, args.trace, work, args.jobs, log, args.keep_runs, scenario)
            result, inf = assemble(plan, results), info(plan, args.trace, scenario)
            if args.keep_runs:
                keep_runs(plan, work, tmp)
            shutil.rmtree(work)
            write_json(tmp / "whatif-info.json", inf)
            write_json(tmp / "whatif.json", result)
    print("\n".join(table(result, inf)))
    print()
    print("\n".join(summary_lines(result, inf)))
    print(f"wrote {out / 'whatif.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sim.whatif ...` (the same as `python -m sim whatif ...`)."""
    parser = argparse.ArgumentParser(prog="python -m sim")
    sub = parser.add_subparsers(dest="command", required=True)
    add_whatif_parser(sub)
    args = parser.parse_args(["whatif", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(run_main(main))
