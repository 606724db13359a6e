"""What a capacity plan is asked: latency SLOs (`--slo key=seconds`) and the candidates to try
(a TOML file, `--vary` and the base config), all checked before any simulation starts.

Candidates file (every list is a dimension; `[grid]` is a product, each `[[config]]` adds its
own small product after it; keys are Contract 2 config keys, dotted or as tables, or `router`;
bubblesim/plan/candidates.example.toml shows every table):

    [grid]
    gpu = ["h100", "h200"]
    batches_in_flight = [1, 2, 3]
    spec.method = ["none", "ngram-gpu"]
    [[config]]
    model = "llama3-70b"
    gpu = "h200"
    [prices]                  # USD per GPU-hour; default bubblesim/core/gpus.py price_per_hour
    h100 = 2.0
    [search]                  # see SearchOptions
    max_replicas = 32
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bubblesim.core.cli import UsageError
from bubblesim.core.config import Config, ConfigError
from bubblesim.core.gpus import GPUS, get_gpu
from bubblesim.core.models import get_model, with_context
from bubblesim.core.tpfit import TP_DEGREES, fit_error, fitting_degrees

ROUTERS: tuple[str, ...] = ("round-robin", "least-outstanding", "prefix-aware")
PLAN_KEYS: tuple[str, ...] = ("router",)  # grid keys that are not config keys
TP_KEY = "tensor_parallel_size"  # GPUs per replica: the plan searches it (SearchOptions)
SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2e", "itl")
SLO_QUANTILES: dict[str, float] = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
_SLO_RE = re.compile(r"^(ttft|tpot|e2e|itl)_(p50|p90|p99)_s$")
SLO_KEYS: tuple[str, ...] = tuple(f"{m}_{q}_s" for m in SLO_METRICS for q in SLO_QUANTILES)


class PlanError(UsageError):
    """A bad SLO, candidate or option: one line, exit code 2, before any simulation."""


@dataclass(frozen=True)
class SLO:
    """`metric` quantile `quantile` of the run (summary key `metric`_s) must be <= `limit_s`."""

    key: str  # "ttft_p99_s"
    metric: str  # "ttft"
    quantile: str  # "p99"
    limit_s: float

    @property
    def q(self) -> float:
        return SLO_QUANTILES[self.quantile]

    def value(self, summary: dict[str, Any]) -> float | None:
        return (summary.get(f"{self.metric}_s") or {}).get(self.quantile)

    def met(self, summary: dict[str, Any]) -> bool:
        """A run with no value for the metric (no request has it) cannot violate it."""
        v = self.value(summary)
        return v is None or v <= self.limit_s


def parse_slos(items: list[str] | None) -> tuple[SLO, ...]:
    if not items:
        raise PlanError(f"give at least one --slo KEY=SECONDS (keys: {', '.join(SLO_KEYS)})")
    out: dict[str, SLO] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        m = _SLO_RE.match(key)
        if not sep or m is None:
            raise PlanError(
                f"--slo '{item}': expected KEY=SECONDS with KEY one of {', '.join(SLO_KEYS)}"
            )
        try:
            limit = float(text)
        except ValueError:
            raise PlanError(f"--slo '{item}': '{text}' is not a number of seconds") from None
        if not (math.isfinite(limit) and limit > 0):
            raise PlanError(f"--slo '{item}': the limit must be a positive number of seconds")
        if key in out:
            raise PlanError(f"--slo '{key}' given twice")
        out[key] = SLO(key, m.group(1), m.group(2), limit)
    return tuple(out[k] for k in SLO_KEYS if k in out)  # a fixed order: keys hash the same


@dataclass(frozen=True)
class SearchOptions:
    loads: tuple[float, ...] = (1.0,)  # trace-load multiples to size a fleet for (1 = as is)
    max_replicas: int = 64
    load_tol: float = 0.05  # bisection stops when hi / lo <= 1 + load_tol
    max_load_factor: float = 64.0
    min_load_factor: float = 1 / 64
    router: str = "least-outstanding"  # for candidates that do not name one
    prefix_abs_tokens: int = 4096  # prefix-aware: stick unless the home is this far above
    prefix_rel: float = 1.5  # ... and this many times the least loaded replica
    early_stop: bool = True  # end a run once its SLO verdict is certain
    # tensor_parallel_size degrees (GPUs per replica) tried for candidates that do not set the
    # key themselves (a grid/config key, or --set with a value above 1): each degree here at
    # which the model fits; () = 1 for a model that fits one GPU, else the smallest degree up
    # to 8 at which it fits and the next one
    tensor_parallel: tuple[int, ...] = ()

    def validate(self) -> None:
        def need(ok: bool, key: str, why: str) -> None:
            if not ok:
                raise PlanError(f"search option '{key}': {why}")

        need(len(self.loads) > 0, "loads", "needs at least one load")
        need(all(x > 0 and math.isfinite(x) for x in self.loads), "loads", "must be > 0")
        need(self.max_replicas >= 1, "max_replicas", "must be >= 1")
        need(0 < self.load_tol < 1, "load_tol", "must be in (0, 1)")
        need(
            0 < self.min_load_factor < 1 < self.max_load_factor,
            "min_load_factor",
            "need 0 < min_load_factor < 1 < max_load_factor",
        )
        need(self.router in ROUTERS, "router", f"must be one of {ROUTERS}")
        need(self.prefix_abs_tokens >= 0, "prefix_abs_tokens", "must be >= 0")
        need(self.prefix_rel >= 1, "prefix_rel", "must be >= 1")
        need(
            all(tp in TP_DEGREES for tp in self.tensor_parallel),
            "tensor_parallel",
            f"degrees must be among {TP_DEGREES}",
        )


@dataclass(frozen=True)
class Candidate:
    """One engine config (and router) whose fleets the plan sizes."""

    index: int
    name: str  # the overrides that make it, "k=v k=v", or "base"
    overrides: dict[str, Any]
    config: Config
    router: str
    price_per_hour: float  # USD per GPU-hour

    @property
    def gpus_per_replica(self) -> int:
        return self.config.tensor_parallel_size


@dataclass(frozen=True)
class PlanSpec:
    slos: tuple[SLO, ...]
    candidates: tuple[Candidate, ...]
    search: SearchOptions
    prices: dict[str, float] = field(default_factory=dict)


# ---- candidates -------------------------------------------------------------------------------
def _flatten_table(table: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten_table(v, where, f"{key}."))
        else:
            out[key] = v
    return out


def _values(key: str, v: Any, where: str) -> list[Any]:
    vals = v if isinstance(v, list) else [v]
    if not vals:
        raise PlanError(f"{where}: key '{key}' has an empty list")
    for x in vals:
        if isinstance(x, dict | list):
            raise PlanError(f"{where}: key '{key}': values must be scalars, got {x!r}")
    return vals


def _expand(group: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The product of a group's lists, in key order then value order."""
    known = set(Config().flat()) | set(PLAN_KEYS)
    flat = _flatten_table(group, where)
    for key in flat:
        if key not in known:
            raise PlanError(f"{where}: unknown key '{key}' (not a config key nor {PLAN_KEYS})")
    keys = list(flat)
    dims = [_values(k, flat[k], where) for k in keys]
    return [dict(zip(keys, combo)) for combo in itertools.product(*dims)]


def parse_vary(items: list[str] | None) -> dict[str, list[str]]:
    """`--vary batches_in_flight=1,2,3` -> {"batches_in_flight": ["1", "2", "3"]}."""
    out: dict[str, list[str]] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        vals = [v.strip() for v in text.split(",") if v.strip()]
        if not sep or not key.strip() or not vals:
            raise PlanError(f"--vary '{item}': expected KEY=V1,V2,...")
        out[key.strip()] = vals
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise PlanError(f"candidates file '{path}' does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"candidates file '{path}': not valid TOML: {e}") from None


def _search_options(table: dict[str, Any], where: str, over: dict[str, Any]) -> SearchOptions:
    types = {f.name: f.type for f in fields(SearchOptions)}
    kw: dict[str, Any] = {}
    for key, v in {**table, **over}.items():
        if key not in types:
            raise PlanError(f"{where} [search]: unknown key '{key}' (known: {sorted(types)})")
        default = getattr(SearchOptions(), key)
        try:
            if key == "tensor_parallel":
                vals = v if isinstance(v, list | tuple) else [v]
                if any(isinstance(x, bool) or int(x) != x for x in vals):
                    raise TypeError
                kw[key] = tuple(sorted({int(x) for x in vals}))
            elif isinstance(default, tuple):
                vals = v if isinstance(v, list | tuple) else [v]
                kw[key] = tuple(float(x) for x in vals)
            elif isinstance(default, bool):
                if not isinstance(v, bool):
                    raise TypeError
                kw[key] = v
            elif isinstance(default, int):
                if isinstance(v, bool) or int(v) != v:
                    raise TypeError
                kw[key] = int(v)
            elif isinstance(default, float):
                kw[key] = float(v)
            else:
                kw[key] = str(v)
        except (TypeError, ValueError):
            raise PlanError(f"{where} [search]: key '{key}': bad value {v!r}") from None
    opts = SearchOptions(**kw)
    opts.validate()
    loads = sorted({round(x, 6) for x in opts.loads} | {1.0})  # the trace's own load always
    return dataclasses.replace(opts, loads=tuple(loads))


def _prices(table: dict[str, Any], where: str) -> dict[str, float]:
    out = {name: spec.price_per_hour for name, spec in GPUS.items()}
    for name, v in table.items():
        if name.lower() not in GPUS:
            raise PlanError(f"{where} [prices]: unknown GPU '{name}' (known: {sorted(GPUS)})")
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise PlanError(f"{where} [prices]: '{name}' must be a positive USD/hour, got {v!r}")
        out[name.lower()] = float(v)
    return out


def _describe(overrides: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in overrides.items()) or "base"


def load_plan_spec(
    slo_items: list[str] | None,
    base: Config,
    candidates_path: str | Path | None = None,
    vary: list[str] | None = None,
    search_over: dict[str, Any] | None = None,
) -> PlanSpec:
    """Parse and check everything a plan needs; PlanError (one line) on the first problem."""
    slos = parse_slos(slo_items)
    data: dict[str, Any] = {}
    where = "command line"
    if candidates_path is not None:
        where = f"candidates file '{candidates_path}'"
        data = _read_toml(Path(candidates_path))
    unknown = [k for k in data if k not in ("grid", "config", "prices", "search")]
    if unknown:
        raise PlanError(
            f"{where}: unknown table '{unknown[0]}' (expected grid, config, prices, search)"
        )
    grid = data.get("grid", {})
    extra = data.get("config", [])
    if not isinstance(grid, dict):
        raise PlanError(f"{where}: 'grid' must be a table")
    if not isinstance(extra, list) or not all(isinstance(x, dict) for x in extra):
        raise PlanError(f"{where}: 'config' must be an array of tables ([[config]])")
    search = _search_options(data.get("search", {}), where, search_over or {})
    prices = _prices(data.get("prices", {}), where)
    groups: list[tuple[dict[str, Any], str]] = []
    vary_map = parse_vary(vary)
    if grid or vary_map or not extra:
        groups.append(({**grid, **vary_map}, f"{where} [grid]"))
    groups += [(g, f"{where} [[config]] #{i + 1}") for i, g in enumerate(extra)]
    cands: list[Candidate] = []
    seen: set[str] = set()
    for group, gwhere in groups:
        for grid_overrides in _expand(group, gwhere):
            for overrides in _with_tp(grid_overrides, base, search, gwhere):
                c = _candidate(len(cands), overrides, base, search, prices, gwhere)
                ident = repr((sorted(c.config.flat().items()), c.router))
                if ident not in seen:  # a string key: iteration order never used
                    seen.add(ident)
                    cands.append(c)
    return PlanSpec(slos, tuple(cands), search, prices)


def _with_tp(
    overrides: dict[str, Any], base: Config, search: SearchOptions, where: str
) -> list[dict[str, Any]]:
    """The candidate at each tensor-parallel degree it is tried at (SearchOptions.
    tensor_parallel): as given when it sets tensor_parallel_size itself (or the base config
    sets it above 1), else one per degree at which the model fits, the degree added to its
    overrides when above 1 (a one-GPU candidate keeps its name). PlanError when the model
    fits at none of them."""
    if TP_KEY in overrides or base.tensor_parallel_size != 1:
        return [overrides]
    name = _describe(overrides)
    cfg_over = {k: v for k, v in overrides.items() if k not in PLAN_KEYS}
    try:
        cfg = base.replace(**cfg_over) if cfg_over else base
        model = with_context(get_model(cfg.model), cfg.max_model_len)
        gpu = get_gpu(cfg.gpu)
    except (ConfigError, ValueError) as e:
        raise PlanError(f"{where}: candidate '{name}': {e}") from None
    degrees = search.tensor_parallel or TP_DEGREES
    fits = fitting_degrees(cfg, model, gpu, degrees)
    if not fits:  # the largest degree tried says why, and at which degree it would fit
        why = fit_error(cfg.replace(tensor_parallel_size=degrees[-1]), model, gpu)
        tried = f" (search option tensor_parallel {list(degrees)})"
        tried = tried if search.tensor_parallel else ""
        raise PlanError(f"{where}: candidate '{name}': {why}{tried}")
    if not search.tensor_parallel:
        # a model that fits one GPU stays there; one that needs tensor parallelism is tried at
        # the smallest degree that fits and the next (more GPUs per replica, fewer replicas,
        # faster steps: which is cheaper for the SLOs is what the plan finds out)
        fits = fits[:1] if fits[0] == 1 else fits[:2]
    return [overrides if tp == 1 else {**overrides, TP_KEY: tp} for tp in fits]


def _candidate(
    index: int,
    overrides: dict[str, Any],
    base: Config,
    search: SearchOptions,
    prices: dict[str, float],
    where: str,
) -> Candidate:
    name = _describe(overrides)
    cfg_over = {k: v for k, v in overrides.items() if k not in PLAN_KEYS}
    router = str(overrides.get("router", search.router))
    if router not in ROUTERS:
        raise PlanError(f"{where}: candidate '{name}': router '{router}' not one of {ROUTERS}")
    try:
        cfg = base.replace(**cfg_over) if cfg_over else base
        gpu = get_gpu(cfg.gpu)
    except (ConfigError, ValueError) as e:
        raise PlanError(f"{where}: candidate '{name}': {e}") from None
    return Candidate(index, name, overrides, cfg, router, prices[gpu.name])
