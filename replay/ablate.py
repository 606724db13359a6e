"""Each seed switch off and on, measured on the engine and predicted by the simulator
(`python -m replay ablate`): ablate.json `{switch: {"measured": {...}, "predicted": {...}}}`.

For every switch the same trace runs twice on the engine (`--repeat N` each, the median run
kept, its spread recorded) and twice in the simulator, with only that key changed from the
given config: the sim's `whatif` variants of the same switch. `rel_change` = (on - off) / off
per metric (fractions also as `change_points`, absolute). A switch that has no effect under
the config (seeds 1, 2 and 5 without speculative decoding) is skipped with the reason; a config
the engine refuses is recorded as an error and the prediction still runs. The simulator (and
so simpy) is imported only here, lazily.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.config import Config
from replay.metrics import flat_metrics, is_fraction, rel_error

# switch -> (off value, on value, why it may not apply)
SWITCHES: dict[str, tuple[Any, Any]] = {
    "preallocated_backup_tokens": (False, True),  # seed 1
    "accepted_count_by_sum": (False, True),  # seed 2
    "reverse_placeholder_scan": (False, True),  # seed 3
    "spec.method": ("ngram-cpu", "ngram-gpu"),  # seed 4
    "optimistic_spec_decode": (False, True),  # seed 5
}
NEEDS_SPEC = ("preallocated_backup_tokens", "accepted_count_by_sum", "optimistic_spec_decode")
EXTRA_BOOL_SWITCHES = ("gc_freeze", "cuda_graphs", "chunked_prefill", "prefix_caching")
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
    from core.cli import UsageError

    if not text:
        return list(SWITCHES)
    out = [s.strip() for s in text.split(",") if s.strip()]
    for s in out:
        if s not in SWITCHES and s not in EXTRA_BOOL_SWITCHES:
            known = [*SWITCHES, *EXTRA_BOOL_SWITCHES]
            raise UsageError(f"--switches: unknown switch '{s}', expected some of {known}")
    return out


def values(switch: str) -> tuple[Any, Any]:
    return SWITCHES.get(switch, (False, True))


def skip_reason(cfg: Config, switch: str) -> str | None:
    if switch in NEEDS_SPEC and not cfg.spec.enabled:
        return "no effect without speculative decoding (set spec.method)"
    return None


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
) -> dict[str, Any]:
    """Run every switch off/on; run folders go to out/<switch>-<off|on>[.sim]."""
    result: dict[str, Any] = {}
    for sw in switches:
        why = skip_reason(cfg, sw)
        if why:
            result[sw] = {"skipped": why}
            write_ablation(result, out)
            continue
        entry: dict[str, Any] = {"values": dict(zip(("off", "on"), values(sw)))}
        variants = {side: cfg.replace(**{sw: v}) for side, v in zip(("off", "on"), values(sw))}
        stem = out / _slug(sw)
        if measure:
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
        if predict:
            entry["predicted"] = _side_by_side(
                variants,
                lambda side, c, stem=stem: _predict(
                    c, trace_path, stem.with_name(f"{stem.name}-{side}.sim")
                ),
            )
        result[sw] = entry
        write_ablation(result, out)  # after every switch: an interruption keeps the rest
        if progress is not None:
            progress(f"{sw}: done")
    return result


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
    return out


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
    from replay.run import replay

    res = replay(c, trace_path, out, repeat=repeat, max_seconds=max_seconds, progress=progress)
    spread = res.summary.get("repeat_spread") or {}
    return {
        "metrics": _pick(res.summary),
        "path": str(out),
        "spread": {m: spread[m].get("range_rel") for m in METRICS if m in spread} or None,
    }


def _predict(c: Config, trace_path: str | Path, out: Path) -> dict:
    from sim.run import simulate  # needs simpy: only here

    res = simulate(c, trace_path, out)
    return {"metrics": _pick(res.summary), "path": str(out)}


def write_ablation(result: dict[str, Any], out: Path) -> Path:
    from replay.outdir import atomic_file

    return atomic_file(out / "ablate.json", json.dumps(result, indent=2) + "\n")


def print_table(result: dict[str, Any]) -> None:
    head = (
        f"{'switch':<28} {'metric':<18} {'measured off':>13} {'on':>11} {'change':>8} "
        f"{'predicted off':>14} {'on':>11} {'change':>8}"
    )
    print(head)
    for sw, e in result.items():
        if "skipped" in e:
            print(f"{sw:<28} skipped: {e['skipped']}")
            continue
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
            print(f"{sw:<28} {m:<18} " + " ".join(cells))


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"
