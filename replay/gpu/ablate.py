"""Each seed switch off and on, measured on the engine and predicted by the simulator
(`python -m replay ablate`): ablate.json `{switch: {"measured": {...}, "predicted": {...}}}`.

For every switch the same trace runs twice on the engine (`--repeat N` each, the median run
kept, each metric's median and spread recorded) and twice in the simulator, with only that key
changed from the given config: the sim's `whatif` variants of the same switch. `rel_change` =
(on - off) / off per metric (fractions also as `change_points`, absolute). A switch that cannot
act under the config (bubblesim.core.switches: seeds 1, 2 and 5 without speculative decoding, seed
5 with
one batch in flight, cuda_graphs_mixed with it) is skipped with the reason; a config the engine
refuses is recorded as an error and the prediction still runs. The simulator (and so simpy) is
imported only here, lazily.

Calibrated mode (`calibrate_on="off"`, CLI `--calibrate-on off`): before predicting a switch,
`replay calibrate` fits the simulator's profile on the measured run of that one side (the
"before" side of every seed switch is `off`), one-sided
(replay.analysis.calibrate.ONE_SIDED_FIELDS), over the config's profile as the base (`--set
profile=`, default: built-in defaults); both sides are then predicted with it, each from its
measured run's own config (the GPU named by the profile), so the other side is out of sample.
`calibrate_also`: more run folders added to that fit (e.g. runs of other traces that exercise a code
path the calibrated side lacks; never the other side). The profile goes to
`<out>/<switch>.profile.json` (+ `.fit.json`) and ablate.json records `calibrated_on`, the runs and
the fit notes. `measured_dir`: take the measured runs from an earlier ablation's output folder
(`<dir>/<switch>-off`, `-on`) instead of running the engine, so a GPU host measures and a host with
the simulator predicts.

A measured side's metrics are each the median over its repeats (`repeats` keeps the values,
`noise` the robust standard error of the on - off difference relative to off: `noise()`).
`agreement` per metric (when both exist): the predicted change has the measured sign, and its
size is within 25 % of the measured size (the issue-6 target), with `size_ratio` = predicted /
measured change, and `resolved`: the measured change exceeds NOISE_SE standard errors (None
with fewer than two repeats a side), without which sign and size are not established.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bubblesim.core.cli import UsageError
from bubblesim.core.config import Config, flatten
from bubblesim.core.runfmt import load_run, trace_info
from bubblesim.core.runfmt.metrics import flat_metrics, is_fraction, rel_error
from bubblesim.core.switches import BY_KEY, cannot_act
from bubblesim.core.switches import SWITCHES as REGISTRY
from replay.analysis.calibrate import ONE_SIDED_FIELDS, calibrate, write_calibration
from replay.analysis.outdir import atomic_file
from replay.analysis.steps import run_config
from replay.gpu.run import replay, replay_interleaved
from sim.cost import load_profile, merge_profile

# the seed switches (bubblesim.core.switches), by config key: ablation side off = before, on = after
SWITCHES: dict[str, tuple[Any, Any]] = {
    s.key: (s.before, s.after) for s in REGISTRY if s.seed is not None
}
EXTRA_BOOL_SWITCHES = (
    "gc_freeze",
    "cuda_graphs",
    "chunked_prefill",
    "prefix_caching",
    *(s.key for s in REGISTRY if s.seed is None),  # cuda_graphs_mixed: engine.mixed_graphs
)
SIDES = ("off", "on")
SIZE_TOLERANCE = 0.25  # predicted change within 25 % of the measured change
NOISE_SE = 2.0  # a measured change within 2 standard errors of the difference is noise
METRICS = (
    "output_tok_per_s",
    "tpot_s.p50",
    "tpot_s.p99",
    "ttft_s.p50",
    "e2e_s.p50",
    "bubble_fraction",
    "gpu_ms_mean",
)


def parse_switches(text: str | None) -> list[str]:
    if not text:
        return list(SWITCHES)
    out = [s.strip() for s in text.split(",") if s.strip()]
    for s in out:
        if s not in SWITCHES and s not in EXTRA_BOOL_SWITCHES:
            known = [*SWITCHES, *EXTRA_BOOL_SWITCHES]
            raise UsageError(f"--switches: unknown switch '{s}', expected some of {known}")
    return out


def values(switch: str) -> tuple[Any, Any]:
    sw = BY_KEY.get(switch)
    return (sw.before, sw.after) if sw is not None else (False, True)


def skip_reason(cfg: Config, switch: str) -> str | None:
    """Why a registry switch cannot act under `cfg` (bubblesim.core.switches.cannot_act), judged on
    its off
    side: the switch's own key is set on both sides (seed 4 turns decoding speculative itself).
    The trace's needs_history requests are not checked (seed 3 runs anyway)."""
    sw = BY_KEY.get(switch)
    return None if sw is None else cannot_act(sw, cfg.replace(**{switch: sw.before}))


def ablate(
    cfg: Config,
    trace_path: str | Path,
    out: Path,
    switches: list[str],
    repeat: int,
    measure: bool = True,
    predict: bool = True,
    max_seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
    measured_dir: Path | None = None,
    calibrate_on: str | None = None,
    calibrate_also: list[Path] | None = None,
    interleave: bool = True,
) -> dict[str, Any]:
    """Run every switch off/on; run folders go to out/<switch>-<off|on>[.sim]. Measured sides
    take turns, repeat by repeat (`interleave`; else all off repeats, then all on)."""
    if calibrate_on is not None and calibrate_on not in SIDES:
        raise ValueError(f"calibrate_on must be one of {SIDES}, not {calibrate_on!r}")
    result: dict[str, Any] = {}
    for sw in switches:
        why = skip_reason(cfg, sw)
        if why:
            result[sw] = {"skipped": why}
            write_ablation(result, out)
            continue
        entry: dict[str, Any] = {"values": dict(zip(SIDES, values(sw)))}
        variants = {side: cfg.replace(**{sw: v}) for side, v in zip(SIDES, values(sw))}
        stem = out / _slug(sw)
        if measured_dir is not None:
            entry["measured"] = _side_by_side(
                variants,
                lambda side, c, sw=sw: _load_measured(
                    Path(measured_dir) / f"{_slug(sw)}-{side}", c, sw, trace_path
                ),
            )
        elif measure and interleave:
            entry["measured"] = _measure_interleaved(
                variants, trace_path, stem, repeat, max_seconds, progress
            )
        elif measure:
            entry["measured"] = _side_by_side(
                variants,
                lambda side, c, stem=stem: _measure(
                    c,
                    trace_path,
                    stem.with_name(f"{stem.name}-{side}"),
                    repeat,
                    max_seconds,
                    progress,
                ),
            )
        if predict and calibrate_on is not None:
            try:
                variants = _calibrated_variants(
                    entry, cfg, sw, calibrate_on, calibrate_also or [], out
                )
            except Exception as e:  # noqa: BLE001 - recorded, like a refused config
                entry["predicted"] = {"error": f"calibration: {type(e).__name__}: {e}"}
                variants = {}
        if predict and variants:
            entry["predicted"] = _side_by_side(
                variants,
                lambda side, c, stem=stem: _predict(
                    c, trace_path, stem.with_name(f"{stem.name}-{side}.sim")
                ),
            )
        if "off" in entry.get("measured", {}) and "off" in entry.get("predicted", {}):
            entry["agreement"] = agreement(entry["measured"], entry["predicted"])
        result[sw] = entry
        write_ablation(result, out)  # after every switch: an interruption keeps the rest
        if progress is not None:
            progress(f"{sw}: done")
    return result


def agreement(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """Per metric: same sign, predicted / measured change, and the 25 % size target."""
    out: dict[str, Any] = {}
    noise_rel = measured.get("noise") or {}
    for m in METRICS:
        a, b = measured["rel_change"].get(m), predicted["rel_change"].get(m)
        if a is None or b is None:
            continue
        ratio = b / a if a else None
        se = noise_rel.get(m)
        out[m] = {
            "same_sign": (a > 0) == (b > 0) and a != 0 and b != 0,
            "size_ratio": ratio,
            "within_target": ratio is not None and abs(ratio - 1.0) <= SIZE_TOLERANCE,
            # is the measured change larger than its noise? (None: too few repeats to say)
            "resolved": None if se is None else abs(a) > NOISE_SE * se,
        }
    return out


def _load_measured(run_dir: Path, c: Config, switch: str, trace_path: str | Path) -> dict:
    """A measured side from an earlier ablation's run folder; it must be the same switch value
    and trace."""
    run = load_run(run_dir)
    got, want_cfg = flatten(run_config(run).to_dict()), flatten(c.to_dict())
    diff = [k for k in want_cfg if k not in IGNORED_KEYS and got.get(k) != want_cfg[k]]
    if diff:
        k = switch if switch in diff else diff[0]
        raise ValueError(
            f"run '{run_dir}' was measured with {k}={got.get(k)!r}, this side needs "
            f"{want_cfg[k]!r} (pass the measured run's --set values)"
        )
    want = trace_info(trace_path)["sha256"]
    have = (run.summary.get("trace") or {}).get("sha256")
    if have != want:
        raise ValueError(f"run '{run_dir}' replayed another trace than '{trace_path}'")
    return _measured_side(run.summary, run_dir)


# config keys a measured run may differ in from the ablation's config: where it ran, and the
# sim's GPU preset and profile (the prediction's business)
IGNORED_KEYS = ("device", "gpu", "profile")


def _calibrated_variants(
    entry: dict[str, Any],
    cfg: Config,
    switch: str,
    side: str,
    also: list[Path],
    out: Path,
) -> dict[str, Config]:
    """Fit the profile on the measured `side` (+ `also`), write it, and return both sides'
    measured configs with it (entry gets `calibration`)."""
    measured = entry.get("measured") or {}
    if "runs" not in measured:
        raise ValueError("needs both sides measured (" + str(measured.get("error")) + ")")
    runs = {s: Path(measured["runs"][s]) for s in SIDES}
    base = load_profile(cfg.profile) if cfg.profile else None
    cal = calibrate([runs[side], *also], base=base, one_sided=ONE_SIDED_FIELDS)
    prof = merge_profile(base, cal.profile) if base else cal.profile
    for key in ("gpu", "model", "dtype", "source_runs", "notes", "date"):  # the fit's own
        if key in cal.profile:
            prof[key] = cal.profile[key]
    path = out / f"{_slug(switch)}.profile.json"
    cal.profile = prof
    fit_report = write_calibration(cal, path, {})
    entry["calibration"] = {
        "calibrated_on": side,
        "runs": [str(runs[side]), *map(str, also)],
        "base_profile": cfg.profile or None,
        "profile": str(path),
        "fit_report": str(fit_report),
        "notes": cal.notes,
    }
    variants = {}
    for s in SIDES:
        c = run_config(load_run(runs[s])).replace(profile=str(path))
        if "gpu" in prof:
            c = c.replace(gpu=prof["gpu"])
        variants[s] = c
    return variants


def _slug(switch: str) -> str:
    return switch.replace(".", "_")


def _side_by_side(variants: dict[str, Config], run: Callable[[str, Config], Any]) -> dict:
    sides: dict[str, Any] = {}
    for side, c in variants.items():
        try:
            sides[side] = run(side, c)
        except Exception as e:  # noqa: BLE001 - recorded: one refused config must not stop the rest
            return {"error": f"{side}: {type(e).__name__}: {e}"}
    off, on = sides["off"]["metrics"], sides["on"]["metrics"]
    out = {
        "off": off,
        "on": on,
        "rel_change": {m: rel_error(on[m], off[m]) for m in METRICS},
        "change_points": {
            m: None if on[m] is None or off[m] is None else 100 * (on[m] - off[m])
            for m in METRICS
            if is_fraction(m)
        },
        "runs": {"off": sides["off"]["path"], "on": sides["on"]["path"]},
    }
    spreads = {s: sides[s].get("spread") for s in ("off", "on") if sides[s].get("spread")}
    if spreads:
        out["spread"] = spreads
    if all("repeats" in sides[s] for s in SIDES):
        out["repeats"] = {s: sides[s]["repeats"] for s in SIDES}
        out["noise"] = {
            m: noise(sides["off"]["repeats"][m], sides["on"]["repeats"][m]) for m in METRICS
        }
    return out


def noise(off: list[Any], on: list[Any]) -> float | None:
    """Standard error of the on - off difference, relative to the off side's median, with each
    side's scale taken robustly (1.4826 x the median absolute deviation: a repeat that paid a
    one-off cost, like Triton compiles the warm-up missed, does not make a large change look
    like noise); None without two repeats a side. A measured change smaller than NOISE_SE of
    these is not told from run-to-run variation."""
    if len(off) < 2 or len(on) < 2 or any(x is None for x in [*off, *on]):
        return None
    m = statistics.median(off)
    if m == 0:
        return None
    var = sum(_robust_sigma(v) ** 2 / len(v) for v in (off, on))
    return math.sqrt(var) / abs(m)


def _robust_sigma(v: list[float]) -> float:
    med = statistics.median(v)
    return 1.4826 * statistics.median(abs(x - med) for x in v)


def _pick(summary: dict[str, Any]) -> dict[str, Any]:
    flat = flat_metrics(summary)
    return {m: flat[m] for m in METRICS}


def _measure(
    c: Config,
    trace_path: str | Path,
    out: Path,
    repeat: int,
    max_seconds: float | None,
    progress: Callable[[str], None] | None,
) -> dict:
    res = replay(c, trace_path, out, repeat=repeat, max_seconds=max_seconds, progress=progress)
    return _measured_side(res.summary, out)


def _measure_interleaved(
    variants: dict[str, Config],
    trace_path: str | Path,
    stem: Path,
    repeat: int,
    max_seconds: float | None,
    progress: Callable[[str], None] | None,
) -> dict:
    """Both sides measured in turns (off, on, off, on, ...): host drift over the call moves
    both alike (replay.gpu.run.replay_interleaved); a side the engine refuses is recorded."""
    outs = {side: stem.with_name(f"{stem.name}-{side}") for side in variants}
    try:
        res = replay_interleaved(variants, trace_path, outs, repeat, max_seconds, True, progress)
    except Exception as e:  # noqa: BLE001 - recorded, like a refused config
        return {"error": f"{type(e).__name__}: {e}"}
    return _side_by_side(variants, lambda side, c: _measured_side(res[side].summary, outs[side]))


def _measured_side(summary: dict[str, Any], path: Path) -> dict:
    """A measured side: each metric's median over the repeats (the run folder is the repeat of
    median throughput, whose TPOT, TTFT, ... need not be the median ones: where arrivals set
    the throughput, as in seed 5's spaced trace, that choice is arbitrary), the repeats' values
    and their range relative to the mean (`spread`)."""
    spread = summary.get("repeat_spread") or {}
    side: dict[str, Any] = {"metrics": _pick(summary), "path": str(path)}
    reps = (summary.get("repeats") or {}).get("metrics") or []
    if len(reps) > 1:
        values = {m: [r.get(m) for r in reps] for m in METRICS}
        side["repeats"] = values
        for m, v in values.items():
            if all(x is not None for x in v):
                side["metrics"][m] = statistics.median(v)
    side["spread"] = {m: spread[m].get("range_rel") for m in METRICS if m in spread} or None
    return side


def _predict(c: Config, trace_path: str | Path, out: Path) -> dict:
    from sim.run import simulate  # needs simpy: only here

    res = simulate(c, trace_path, out)
    return {"metrics": _pick(res.summary), "path": str(out)}


def write_ablation(result: dict[str, Any], out: Path) -> Path:
    return atomic_file(out / "ablate.json", json.dumps(result, indent=2) + "\n")


def print_table(result: dict[str, Any]) -> None:
    head = (
        f"{'switch':<28} {'metric':<18} {'measured off':>13} {'on':>11} {'change':>8} "
        f"{'predicted off':>14} {'on':>11} {'change':>8}  verdict"
    )
    print(head)
    for sw, e in result.items():
        if "skipped" in e:
            print(f"{sw:<28} skipped: {e['skipped']}")
            continue
        cal = e.get("calibration")
        if cal:
            print(f"{sw:<28} predicted with a profile calibrated on the '{cal['calibrated_on']}'"
                  f" side: {cal['profile']}")  # fmt: skip
        agree = e.get("agreement") or {}
        for m in METRICS:
            cells = []
            for kind in ("measured", "predicted"):
                d = e.get(kind) or {}
                if "off" not in d:
                    cells.append(f"{(d.get('error') or '-')[:35]:>34}")
                    continue
                rc = d["rel_change"][m]
                cells.append(
                    f"{_f(d['off'][m]):>13} {_f(d['on'][m]):>11} "
                    f"{'-' if rc is None else f'{100 * rc:+.1f}%':>8}"
                )
            print(f"{sw:<28} {m:<18} " + " ".join(cells) + "  " + verdict(agree.get(m)))


def verdict(a: dict[str, Any] | None) -> str:
    """An `agreement` entry in words (the table above, reports/ablate/tables.py)."""
    if not a:
        return ""
    if not a["same_sign"]:
        v = "sign differs"
    else:
        v = "ok" if a["within_target"] else f"size x{a['size_ratio']:.2f}"
    return v + (" (measured change within noise)" if a.get("resolved") is False else "")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"
