"""A trace's own scenario: config keys stored in the trace file, applied below the user's.

A trace built to show one effect (the seed traces, `traces/build.py`) carries the config it
shows it under, as TOML text in its parquet key-value metadata under `SCENARIO_KEY`. `sim run`
and `sim whatif` apply it as the lowest config layer: defaults < scenario < --config < --set
(`--no-scenario` skips it). The text is checked when it is written and again when it is read:
a malformed scenario is one ConfigError naming the trace.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bubblesim.core.config import Config, ConfigError, flatten, from_dict, load_config

SCENARIO_KEY = "bubblesim.scenario"


@dataclass(frozen=True)
class Scenario:
    trace: str  # the trace file it came from
    data: dict[str, Any]  # nested, as in a TOML config file

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value, in file order."""
        return flatten(self.data)

    def keys_text(self) -> str:
        """`key=value ...`, as --set spells them."""
        return " ".join(f"{k}={_show(v)}" for k, v in self.flat().items())

    def line(self) -> str:
        """The one line a command prints when it applies the scenario."""
        return (
            f"scenario of {self.trace} applied: {self.keys_text()} "
            "(--config and --set override it; --no-scenario skips it)"
        )


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def parse_scenario(text: str, where: str) -> dict[str, Any]:
    """The scenario's keys, checked as a config (ConfigError naming `where` otherwise)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: scenario '{SCENARIO_KEY}' is not valid TOML: {e}") from None
    try:
        from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{where}: scenario '{SCENARIO_KEY}': {e}") from None
    return data


def read_scenario(trace_path: str | Path) -> Scenario | None:
    """The scenario a trace file carries (None without one, or when the file is unreadable:
    reading the trace itself reports that)."""
    try:
        meta = pq.read_schema(trace_path).metadata or {}
    except (OSError, pa.ArrowException):
        return None
    raw = meta.get(SCENARIO_KEY.encode())
    if raw is None:
        return None
    where = f"trace '{trace_path}'"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: scenario '{SCENARIO_KEY}' is not UTF-8 text") from None
    return Scenario(str(trace_path), parse_scenario(text, where))


def config_for_trace(
    trace_path: str | Path,
    config_path: str | Path | None,
    sets: list[str] | None,
    use_scenario: bool = True,
) -> tuple[Config, Scenario | None]:
    """The config a command runs `trace_path` with (defaults < the trace's scenario <
    `config_path` < `sets`) and the scenario applied, if any."""
    scenario = read_scenario(trace_path) if use_scenario else None
    return load_config(config_path, sets, base=scenario.data if scenario else None), scenario
