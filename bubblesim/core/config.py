"""The one config read by `sim` and `replay` (docs/contracts.md Contract 2).

A config comes from a TOML file plus `--set key=value` overrides, is validated on creation and is
written into every run's output, so a run can be reproduced from its output alone. Nested tables
(`[spec]`, `[sampling]`, `[gc]`) map to dotted keys (`spec.k`). The CLI and the TOML reader are
built from the dataclass fields; there is no second hand-written list of keys.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad config: the message names the key."""


SPEC_METHODS = ("none", "ngram-cpu", "ngram-gpu")
DTYPES = ("bfloat16", "float16", "float32")
DEVICES = ("cuda", "cpu")
TP_ALLREDUCE = ("nccl", "oneshot", "fused")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "none"  # none | ngram-cpu | ngram-gpu (seed 4 is cpu vs gpu)
    k: int = 3  # draft tokens per step
    min_n: int = 2  # n-gram match lengths tried, longest first
    max_n: int = 4

    def validate(self) -> None:
        _check(self.method in SPEC_METHODS, "spec.method", f"must be one of {SPEC_METHODS}")
        _check(1 <= self.k <= 16, "spec.k", "must be in 1..16")
        _check(1 <= self.min_n <= self.max_n, "spec.min_n", "must be >= 1 and <= spec.max_n")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling for requests; penalties apply only to requests with `needs_history`."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.1
    frequency_penalty: float = 0.1
    presence_penalty: float = 0.1

    @property
    def has_penalties(self) -> bool:
        """Any penalty that changes a logit (the engine's penalties path runs only then)."""
        return not (
            self.repetition_penalty == 1.0
            and self.frequency_penalty == 0
            and self.presence_penalty == 0
        )

    def validate(self) -> None:
        _check(self.temperature >= 0, "sampling.temperature", "must be >= 0")
        _check(self.top_k >= 0, "sampling.top_k", "must be >= 0")
        _check(0 < self.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
        _check(self.repetition_penalty > 0, "sampling.repetition_penalty", "must be > 0")


@dataclass(frozen=True)
class GCConfig:
    """Python garbage-collector model (sim) and settings (engine)."""

    model: bool = True  # sim: model GC pauses at all (off shows their contribution)
    threshold0: int = 700  # CPython generational thresholds
    threshold1: int = 10
    threshold2: int = 10
    startup_objects: int = 400_000  # tracked objects alive after start-up (frozen by gc_freeze)

    def validate(self) -> None:
        for name in ("threshold0", "threshold1", "threshold2"):
            _check(getattr(self, name) >= 1, f"gc.{name}", "must be >= 1")
        _check(self.startup_objects >= 0, "gc.startup_objects", "must be >= 0")


@dataclass(frozen=True)
class Config:
    model: str = "llama3-8b"  # preset name or a Hugging Face checkpoint folder
    gpu: str = "h100"  # the GPU the sim models (replay records the real one)
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0  # 0 = the model's context length
    block_size: int = 16
    kv_memory_fraction: float = 0.9
    num_kv_blocks: int = 0  # 0 = derived from memory; > 0 forces a KV budget (tests, preemption)
    chunked_prefill: bool = True
    prefix_caching: bool = True
    cuda_graphs: bool = True
    # prefill/mixed steps replay CUDA graphs captured per token bucket (engine.mixed_graphs,
    # bubblesim.core.graph_buckets); with speculative decoding those steps stay eager
    cuda_graphs_mixed: bool = False
    gc_freeze: bool = True
    batches_in_flight: int = 2  # 1 = synchronous; 2, 3 = async scheduling depth
    # GPUs per replica, one rank each (Megatron-style column/row-parallel layers; rank 0 runs the
    # scheduling policy and sends each step's inputs to the others: CPU phase `broadcast`)
    tensor_parallel_size: int = 1
    # the model's all-reduces at tp > 1: "nccl" (ring, every size) or "oneshot" (messages up to
    # bubblesim.core.collectives.ONESHOT_MAX_BYTES[tp] in one kernel that reads every peer's copy
    # through symmetric memory, vLLM's custom all-reduce idea; larger ones still NCCL)
    tp_allreduce: str = "nccl"
    optimistic_spec_decode: bool = True  # seed 5 (PR 32951)
    preallocated_backup_tokens: bool = True  # seed 1 (PR 41043)
    accepted_count_by_sum: bool = True  # seed 2 (PR 38372)
    reverse_placeholder_scan: bool = True  # seed 3 (PR 42938)
    profile: str = ""  # sim: a cost profile file written by `replay calibrate`
    # sim: the host's speed against the profile's: every CPU phase's modelled time (launch and
    # the TP broadcast included; GC pauses and waits not) x this. 1 = the profile's host; 1.3 =
    # a host 1.3x slower. Hosts differ, and one host's level moves between runs by up to 1.75x
    # (reports/fidelity/README.md section 1); replay ignores it (it measures the host it has)
    host_scale: float = 1.0
    arrival: str = "realtime"  # realtime (open loop) | asap (all queued at time 0)
    spec: SpecConfig = field(default_factory=SpecConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    gc: GCConfig = field(default_factory=GCConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check(bool(self.model), "model", "must name a preset or a checkpoint folder")
        _check(self.device in DEVICES, "device", f"must be one of {DEVICES}")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.max_model_len >= 0, "max_model_len", "must be >= 0 (0 = model context)")
        _check(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            "must be a power of two",
        )
        _check(0 < self.kv_memory_fraction <= 1, "kv_memory_fraction", "must be in (0, 1]")
        _check(self.num_kv_blocks >= 0, "num_kv_blocks", "must be >= 0")
        _check(self.batches_in_flight in (1, 2, 3), "batches_in_flight", "must be 1, 2 or 3")
        _check(
            self.tensor_parallel_size in (1, 2, 4, 8),
            "tensor_parallel_size",
            "must be 1, 2, 4 or 8",
        )
        _check(self.tp_allreduce in TP_ALLREDUCE, "tp_allreduce", f"must be one of {TP_ALLREDUCE}")
        _check(
            self.cuda_graphs or not self.cuda_graphs_mixed, "cuda_graphs_mixed", "needs cuda_graphs"
        )
        _check(self.arrival in ("realtime", "asap"), "arrival", "must be realtime or asap")
        _check(0 < self.host_scale <= 100, "host_scale", "must be in (0, 100]")
        _check(
            self.chunked_prefill or self.max_num_batched_tokens >= 1,
            "chunked_prefill",
            "needs a token budget",
        )
        self.spec.validate()
        self.sampling.validate()
        self.gc.validate()

    @property
    def depth(self) -> int:
        """Batches actually in flight. ngram-cpu proposes from the sampled tokens on the host,
        so each step waits for the previous one's tokens: it runs synchronously (depth 1, as
        vLLM does) whatever `batches_in_flight` says."""
        return 1 if self.spec.method == "ngram-cpu" else self.batches_in_flight

    # ---- conversion -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **overrides: Any) -> Config:
        """A copy with dotted-key overrides (`{"spec.k": 4}`), values already typed."""
        return from_dict(_merge(self.to_dict(), _nest(overrides)))

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value, the form `--set` uses."""
        return flatten(self.to_dict())


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': {why}")


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted keys (`{"spec": {"k": 3}}` -> `{"spec.k": 3}`)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{key}': '{p}' is not a table")
        node[leaf] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check (TOML) or parse (`--set` strings) one leaf value against its field type."""
    if isinstance(typ, types.UnionType):
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        try:
            if typ is bool:
                low = text.lower()
                if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                return low in ("true", "1", "yes", "on")
            if typ is int:
                return int(text)
            if typ is float:
                return float(text)
        except ValueError:
            raise ConfigError(
                f"config key '{key}': expected {typ.__name__}, got {value!r}"
            ) from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"config key '{key}': expected bool, got {value!r}")
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"config key '{key}': expected int, got {value!r}")
    if typ in (str, float) and not isinstance(value, typ):
        raise ConfigError(f"config key '{key}': expected {typ.__name__}, got {value!r}")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"config key '{full}': unknown key")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{full}': expected a table of keys")
            kwargs[key] = _build(typ, value, f"{full}.")  # type: ignore[arg-type]
        else:
            kwargs[key] = _coerce(full, value, typ)
    return cls(**kwargs)


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from a nested dict (TOML or a run's summary.json)."""
    return _build(Config, data)


def parse_sets(sets: list[str] | None) -> dict[str, Any]:
    """`["spec.k=4", "model=tiny"]` -> `{"spec.k": "4", "model": "tiny"}` (coerced later)."""
    out: dict[str, Any] = {}
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set '{item}': expected key=value")
        out[key.strip()] = value
    return out


def load_config(
    path: str | Path | None = None,
    sets: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> Config:
    """Read a TOML config (optional) and apply `--set key=value` overrides, both over `base`
    (nested keys, e.g. a trace's scenario: bubblesim.core.scenario) when given."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{p}': not valid TOML: {e}") from None
    return from_dict(_merge(_merge(base or {}, data), _nest(parse_sets(sets))))
