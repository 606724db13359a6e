"""Cost profile files (JSON): validation, merging over the defaults, atomic save and load.

A profile holds any subset of `defaults.DEFAULTS` (docs/cost-model.md describes every key). A
bad profile gets one `ProfileError` naming the key. Merging rules: parameter tables
(`gpu_pass.roofline`, `launch`, `ngram_gpu`, `gc`) merge key by key; a linear model (a phase,
a term, `sync`, `gpu_pass.decode`/`mixed`) is replaced whole, since a fit's coefficients only
make sense together. `gpu_pass.decode` and `mixed` may also be `{"max": [LINEAR, LINEAR, ...]}`
(the larger of its branches); decode models may use the derived terms `program_keys` and `tail_keys`
(sim.cost.splits), mixed ones `mixed_keys` and `grid_blocks` (sim.cost.mixedsplits).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bubblesim.core.atomic import replacing
from bubblesim.core.config import TP_ALLREDUCE, ConfigError
from bubblesim.core.phases import CPU_PHASES

from .defaults import DEFAULTS, PROFILE_VERSION, default_profile
from .envelope import EnvelopeError, check_envelope
from .hostspeed import HOST_KEY, HostSpeedError, check_host_speed
from .linear import DECODE_TERMS, LINEAR_TERMS, MAX_KEY, MIXED_TERMS
from .mixedsplits import GRID_RULES
from .sampling import SAMPLING_KEY, SamplingTableError, check_sampling
from .spread import RANKS_KEY, SPREAD_KEY, SpreadError, check_spread
from .table import NONLINEAR_KEYS, TABLE_KEY, TableError, check_spline, check_table
from .terms import TERM_NAMES


class ProfileError(ConfigError):
    """A bad cost profile: the message names the key."""


META_STR_KEYS = ("gpu", "model", "dtype", "date", "notes")
PARAM_TABLES = (
    "gpu_pass.roofline",
    "gpu_pass.idle_start",
    "gpu_pass.history",
    "gpu_pass.allreduce",
    "gpu_pass.allreduce_oneshot",
    "gpu_pass.allreduce_fused",
    "launch",
    "ngram_gpu",
    "sync_wait",
    "intake",
    "history_host",
)
# top-level parameter tables: checked and merged key by key
TOP_PARAM_TABLES = ("launch", "ngram_gpu", "sync_wait", "intake", "history_host")
# gpu_pass's, merged key by key
GPU_PARAM_TABLES = (
    "roofline", "idle_start", "history", "allreduce", "allreduce_oneshot", "allreduce_fused",
)  # fmt: skip
GPU_FIT_KINDS = ("decode", "mixed", "verify")
EFFICIENCY_KEYS = (
    "mem_efficiency",
    "matmul_efficiency",
    "attn_efficiency",
    "scale",
    "bw_efficiency",
)
# the tensor-parallel degree the profile's GPU fits were measured at (sim.cost.model refuses
# it for another degree; a profile without it and with fitted GPU models is for degree 1)
TP_KEY = "tensor_parallel_size"
# the tp_allreduce of the runs the GPU fits were measured on (absent: nccl); the simulator adds
# the difference to another algorithm in the config (sim.cost.model)
ALLREDUCE_KEY = "tp_allreduce"
# the rule of the mixed grid_blocks / mixed_keys terms the mixed fits were made with
# (sim.cost.mixedsplits.GRID_RULES; absent: "mean", the rule before the longest chunk's)
MIXED_GRID_KEY = "mixed_grid"
# the calibration runs' host probe level (replay.analysis.probe): {"level": x, "runs": n}; the
# simulator does not read it: a target host's probe over it is that host's `host_scale`
PROBE_KEY = "host_probe"
TOP_KEYS = (
    "version",
    *META_STR_KEYS,
    TP_KEY,
    ALLREDUCE_KEY,
    MIXED_GRID_KEY,
    "source_runs",
    "envelope_runs",  # runs that gave the CPU phases their shape only (replay calibrate --envelope)
    "gpu_pass",
    "launch",
    "cpu_phases",
    SPREAD_KEY,
    HOST_KEY,
    PROBE_KEY,
    RANKS_KEY,
    "terms",
    "ngram_gpu",
    "sync",
    "sync_wait",
    "intake",
    "history_host",
    SAMPLING_KEY,
    "gc",
    "alloc_objects",
    "alloc_terms",
    "envelope",
)


def _fail(where: str, key: str, why: str) -> ProfileError:
    return ProfileError(f"cost profile{where}: key '{key}': {why}")


def _number(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(where, key, f"expected a finite number, got {value!r}")
    return float(value)


def _table(where: str, key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, key, f"expected an object, got {value!r}")
    return value


def _known(where: str, prefix: str, table: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for k in table:
        if k not in allowed:
            raise _fail(where, f"{prefix}{k}", f"unknown key, expected one of {list(allowed)}")


def _check_linear(where: str, key: str, value: Any, terms: tuple[str, ...] = LINEAR_TERMS) -> None:
    model = _table(where, key, value)
    _known(where, f"{key}.", model, terms)
    for term, coef in model.items():
        _number(where, f"{key}.{term}", coef)


def _check_gpu_model(where: str, key: str, value: Any, terms: tuple[str, ...]) -> None:
    """A linear model over `terms`, plus at most one `table` or `spline` term."""
    model = _table(where, key, value)
    nonlin = [k for k in NONLINEAR_KEYS if k in model]
    if len(nonlin) > 1:
        raise _fail(where, f"{key}.{nonlin[1]}", "a model holds one table or spline term")
    for k in nonlin:
        check = check_table if k == TABLE_KEY else check_spline
        try:
            check(model[k])
        except TableError as e:
            raise _fail(where, f"{key}.{k}" + (f".{e.key}" if e.key else ""), e.why) from None
    _check_linear(where, key, {t: c for t, c in model.items() if t not in nonlin}, terms)


def _check_decode(where: str, key: str, value: Any, terms: tuple[str, ...] = DECODE_TERMS) -> None:
    """A GPU model over `terms`, or `{"max": [model, model, ...]}` (2 or more)."""
    model = _table(where, key, value)
    if MAX_KEY not in model:
        _check_gpu_model(where, key, model, terms)
        return
    if len(model) > 1:
        other = next(k for k in model if k != MAX_KEY)
        raise _fail(where, f"{key}.{other}", "a max form holds only the key 'max'")
    parts = model[MAX_KEY]
    if not isinstance(parts, list) or len(parts) < 2:
        raise _fail(where, f"{key}.{MAX_KEY}", f"expected a list of 2 or more linear models, "
                    f"got {parts!r}")  # fmt: skip
    for i, part in enumerate(parts):
        _check_gpu_model(where, f"{key}.{MAX_KEY}[{i}]", part, terms)


def _check_params(where: str, key: str, value: Any) -> None:
    """A parameter table: the keys of the default table, numbers of the same kind."""
    table = _table(where, key, value)
    node: Any = DEFAULTS
    for part in key.split("."):
        node = node[part]
    _known(where, f"{key}.", table, tuple(node))
    for k, v in table.items():
        full = f"{key}.{k}"
        x = _number(where, full, v)
        if isinstance(node[k], int) and x != int(x):
            raise _fail(where, full, f"expected an integer, got {v!r}")
        if k in EFFICIENCY_KEYS and not 0 < x <= 1:
            raise _fail(where, full, f"must be in (0, 1], got {v!r}")
        if k.endswith("shrink_max_fraction") and not 0 <= x < 1:
            raise _fail(where, full, f"must be in [0, 1), got {v!r}")
        if k == "pnorm" and x < 1:
            raise _fail(where, full, f"must be >= 1, got {v!r}")
        if k != "pnorm" and x < 0:
            raise _fail(where, full, f"must be >= 0, got {v!r}")


def _check_linear_map(where: str, key: str, value: Any, names: tuple[str, ...]) -> None:
    table = _table(where, key, value)
    _known(where, f"{key}.", table, names)
    for name, model in table.items():
        _check_linear(where, f"{key}.{name}", model)


def _check_gc(where: str, value: Any) -> None:
    table = _table(where, "gc", value)
    _known(where, "gc.", table, ("pause_ms", "pause_ms_per_object"))
    for k, v in table.items():
        if not isinstance(v, list) or len(v) != 3:
            raise _fail(where, f"gc.{k}", f"expected a list of 3 numbers (gen 0, 1, 2), got {v!r}")
        for g, x in enumerate(v):
            if _number(where, f"gc.{k}[{g}]", x) < 0:
                raise _fail(where, f"gc.{k}[{g}]", f"must be >= 0, got {x!r}")


def _check_spread(where: str, value: Any, name: str = SPREAD_KEY) -> None:
    """`cpu_spread`: per CPU phase, a quantile table of measured / predicted (sim.cost.spread)."""
    table = _table(where, name, value)
    _known(where, f"{name}.", table, CPU_PHASES)
    for phase, t in table.items():
        try:
            check_spread(t)
        except SpreadError as e:
            key = f"{name}.{phase}" + (f".{e.key}" if e.key else "")
            raise _fail(where, key, e.why) from None


def _check_ranks(where: str, value: Any) -> None:
    """`tp_ranks`: where the worker ranks' eager launches end (sim.cost.spread)."""
    ranks = _table(where, RANKS_KEY, value)
    _known(where, f"{RANKS_KEY}.", ranks, ("intercept", "slope", "residual", "steps"))
    for k in ("intercept", "slope", "residual"):
        if k not in ranks:
            raise _fail(where, f"{RANKS_KEY}.{k}", "missing")
    _number(where, f"{RANKS_KEY}.intercept", ranks["intercept"])
    _number(where, f"{RANKS_KEY}.slope", ranks["slope"])
    try:
        check_spread(ranks["residual"])
    except SpreadError as e:
        key = f"{RANKS_KEY}.residual" + (f".{e.key}" if e.key else "")
        raise _fail(where, key, e.why) from None
    steps = ranks.get("steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise _fail(where, f"{RANKS_KEY}.steps", f"expected a count, got {steps!r}")


def _check_host_speed(where: str, value: Any) -> None:
    """`host_speed`: the host's slowly varying speed (sim.cost.hostspeed)."""
    try:
        spread = check_host_speed(value)
    except HostSpeedError as e:
        raise _fail(where, HOST_KEY + (f".{e.key}" if e.key else ""), e.why) from None
    if spread is not None:
        _check_spread(where, spread, f"{HOST_KEY}.{SPREAD_KEY}")


def validate_profile(data: Any, path: str | Path | None = None) -> dict[str, Any]:
    """Check a (partial) profile; return it unchanged. Raises ProfileError naming the key."""
    where = f" '{path}'" if path is not None else ""
    prof = _table(where, "(top level)", data)
    _known(where, "", prof, TOP_KEYS)
    if "version" not in prof:
        raise _fail(where, "version", f"missing (this reader knows version {PROFILE_VERSION})")
    if prof["version"] != PROFILE_VERSION or isinstance(prof["version"], bool):
        raise _fail(where, "version", f"expected {PROFILE_VERSION}, got {prof['version']!r}")
    for k in META_STR_KEYS:
        if k in prof and not isinstance(prof[k], str):
            raise _fail(where, k, f"expected a string, got {prof[k]!r}")
    tp = prof.get(TP_KEY, 1)
    if isinstance(tp, bool) or tp not in (1, 2, 4, 8):
        raise _fail(where, TP_KEY, f"expected 1, 2, 4 or 8, got {tp!r}")
    if ALLREDUCE_KEY in prof and prof[ALLREDUCE_KEY] not in TP_ALLREDUCE:
        raise _fail(where, ALLREDUCE_KEY, f"expected one of {TP_ALLREDUCE}, got "
                    f"{prof[ALLREDUCE_KEY]!r}")  # fmt: skip
    if MIXED_GRID_KEY in prof and prof[MIXED_GRID_KEY] not in GRID_RULES:
        raise _fail(where, MIXED_GRID_KEY, f"expected one of {GRID_RULES}, got "
                    f"{prof[MIXED_GRID_KEY]!r}")  # fmt: skip
    for key in ("source_runs", "envelope_runs"):
        runs = prof.get(key, [])
        if not isinstance(runs, list) or not all(isinstance(r, str) for r in runs):
            raise _fail(where, key, f"expected a list of strings, got {runs!r}")
    if "gpu_pass" in prof:
        gp = _table(where, "gpu_pass", prof["gpu_pass"])
        _known(where, "gpu_pass.", gp, (*GPU_PARAM_TABLES, *GPU_FIT_KINDS))
        for table in GPU_PARAM_TABLES:
            if table in gp:
                _check_params(where, f"gpu_pass.{table}", gp[table])
        for kind in ("decode", "verify"):
            if kind in gp:
                _check_decode(where, f"gpu_pass.{kind}", gp[kind])
        if "mixed" in gp:
            _check_decode(where, "gpu_pass.mixed", gp["mixed"], MIXED_TERMS)
    for key in TOP_PARAM_TABLES:
        if key in prof:
            _check_params(where, key, prof[key])
    for key, names in (
        ("cpu_phases", CPU_PHASES),
        ("alloc_objects", CPU_PHASES),
        ("terms", TERM_NAMES),
        ("alloc_terms", TERM_NAMES),
    ):
        if key in prof:
            _check_linear_map(where, key, prof[key], names)
    if SPREAD_KEY in prof:
        _check_spread(where, prof[SPREAD_KEY])
    if HOST_KEY in prof:
        _check_host_speed(where, prof[HOST_KEY])
    if PROBE_KEY in prof:
        probe = _table(where, PROBE_KEY, prof[PROBE_KEY])
        _known(where, f"{PROBE_KEY}.", probe, ("level", "runs"))
        if _number(where, f"{PROBE_KEY}.level", probe.get("level")) <= 0:
            raise _fail(where, f"{PROBE_KEY}.level", "must be > 0")
    if RANKS_KEY in prof:
        _check_ranks(where, prof[RANKS_KEY])
    if SAMPLING_KEY in prof:
        try:
            check_sampling(prof[SAMPLING_KEY])
        except SamplingTableError as e:
            raise _fail(where, SAMPLING_KEY + (f".{e.key}" if e.key else ""), e.why) from None
    if "sync" in prof:
        _check_linear(where, "sync", prof["sync"])
    if "gc" in prof:
        _check_gc(where, prof["gc"])
    if "envelope" in prof:
        try:
            check_envelope(prof["envelope"])
        except EnvelopeError as e:
            raise _fail(where, "envelope" + (f".{e.key}" if e.key else ""), e.why) from None
    return prof


def merge_profile(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on top of `base` (both valid): parameter tables key by key, linear models whole."""
    out = json.loads(json.dumps(base))  # deep copy of plain JSON data
    for key, value in over.items():
        if key == "gpu_pass":
            gp = out.setdefault("gpu_pass", {})
            for sub, v in value.items():
                fit = json.loads(json.dumps(v))  # a max form holds a list: copy it too
                params = sub in GPU_PARAM_TABLES  # parameter tables: key by key
                gp[sub] = {**gp.get(sub, {}), **v} if params else fit
        elif key in (*TOP_PARAM_TABLES, "gc"):
            out[key] = {**out.get(key, {}), **value}
        elif key in ("cpu_phases", "alloc_objects", "terms", "alloc_terms", SPREAD_KEY):
            out[key] = {**out.get(key, {}), **{n: dict(m) for n, m in value.items()}}
        else:
            out[key] = json.loads(json.dumps(value))
    return out


def resolve_profile(over: Mapping[str, Any] | None) -> dict[str, Any]:
    """The defaults with a validated (partial) profile on top."""
    return merge_profile(default_profile(), over or {})


def load_profile(path: str | Path) -> dict[str, Any]:
    """Read and validate a profile file (possibly partial; not merged with the defaults)."""
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"config key 'profile': file '{p}' does not exist")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"cost profile '{p}': not valid JSON: {e}") from None
    return validate_profile(data, p)


def save_profile(path: str | Path, profile: Mapping[str, Any]) -> Path:
    """Validate and write a profile atomically (temp file in the same folder, then rename)."""
    validate_profile(profile, path)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with replacing(p) as tmp:  # follows the umask; removed on failure
        tmp.write_text(json.dumps(profile, indent=2) + "\n")
    return p
