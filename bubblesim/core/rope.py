"""The RoPE settings of a Hugging Face Llama-family config.json, read as transformers 5.x reads them
(`modeling_rope_utils`: `convert_rope_params_to_dict`, `standardize_rope_params` and the
`_compute_*_parameters` functions), as `ModelSpec` fields.

Two layouts exist. Current transformers writes `rope_parameters` with `rope_theta` inside it;
older configs have `rope_scaling` (None when unscaled) next to a top-level `rope_theta`, and the
type under `type` in the oldest ones. A non-empty `rope_scaling` wins over `rope_parameters`, and a
`rope_theta` inside the dict over the top-level one, as in transformers.

Supported `rope_type`: default, linear, dynamic (NTK), llama3, yarn. Anything else (longrope,
per-layer-type parameters, partial rotary with scaling, a malformed value) raises one ValueError
naming the key and the value. The frequencies themselves are computed in `engine.rope`.
"""

from __future__ import annotations

import math
from typing import Any

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
DEFAULT_THETA = 10_000.0  # transformers' `default_theta` when a config names none
HF_MAX_POSITIONS = 2048  # LlamaConfig's max_position_embeddings when config.json omits it


def _number(value: Any, key: str, *, positive: bool = True) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or (positive and value <= 0):
        want = "a positive number" if positive else "a number"
        raise ValueError(f"config key '{key}': must be {want}, got {value!r}")
    return float(value)


def _integer(value: Any, key: str) -> int:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or value <= 0 or value != int(value):
        raise ValueError(f"config key '{key}': must be a positive integer, got {value!r}")
    return int(value)


def _required(params: dict[str, Any], where: str, name: str, rope_type: str) -> Any:
    if name not in params:
        raise ValueError(f"config key '{where}.{name}': missing (rope_type {rope_type!r} needs it)")
    return params[name]


def _original_max(cfg: dict[str, Any], params: dict[str, Any], where: str) -> int:
    """llama3 and yarn: a top-level original_max_position_embeddings wins (transformers' Phi-3
    rule), then the dict's, then max_position_embeddings."""
    if "original_max_position_embeddings" in cfg:
        return _integer(cfg["original_max_position_embeddings"], "original_max_position_embeddings")
    if params.get("original_max_position_embeddings") is not None:
        key = f"{where}.original_max_position_embeddings"
        return _integer(params["original_max_position_embeddings"], key)
    return _max_positions(cfg)


def _max_positions(cfg: dict[str, Any]) -> int:
    return _integer(cfg.get("max_position_embeddings", HF_MAX_POSITIONS), "max_position_embeddings")


def _yarn_attention_factor(params: dict[str, Any], where: str, factor: float) -> float:
    """The cos/sin multiplier: attention_factor if given, else from mscale / mscale_all_dim."""
    if params.get("attention_factor") is not None:
        return _number(params["attention_factor"], f"{where}.attention_factor")

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # truthiness, as transformers tests them
        m = _number(mscale, f"{where}.mscale", positive=False)
        m_all = _number(mscale_all_dim, f"{where}.mscale_all_dim", positive=False)
        return get_mscale(factor, m) / get_mscale(factor, m_all)
    return get_mscale(factor)


def _scaled_fields(
    cfg: dict[str, Any], params: dict[str, Any], where: str, rope_type: str
) -> dict[str, Any]:
    """The fields of a scaled rope_type (all but default)."""
    if rope_type == "yarn":
        raw = _required(params, where, "factor", rope_type)
        original = _original_max(cfg, params, where)
        # a null factor means max_position_embeddings / original (DeepSeek-V3's convention)
        factor = _max_positions(cfg) / original if raw is None else _number(raw, f"{where}.factor")
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(
                f"config key '{where}.truncate': must be true or false, got {truncate!r}"
            )
        beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
        return dict(
            rope_scaling_factor=factor,
            rope_original_max_context=original,
            rope_beta_fast=_number(beta_fast, f"{where}.beta_fast"),
            rope_beta_slow=_number(beta_slow, f"{where}.beta_slow"),
            rope_truncate=truncate,
            rope_attention_factor=_yarn_attention_factor(params, where, factor),
        )
    factor = _required(params, where, "factor", rope_type)
    fields: dict[str, Any] = dict(rope_scaling_factor=_number(factor, f"{where}.factor"))
    if rope_type == "dynamic":  # the NTK base grows past config.max_position_embeddings
        fields["rope_original_max_context"] = _max_positions(cfg)
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor"):
            value = _required(params, where, name, rope_type)
            fields[f"rope_{name}"] = _number(value, f"{where}.{name}", positive=False)
        fields["rope_original_max_context"] = _original_max(cfg, params, where)
    return fields


def rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json (parsed) -> the `ModelSpec` rope_* keyword arguments it implies."""
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = cfg.get(where) or {}
    if not isinstance(params, dict):
        raise ValueError(f"config key '{where}': must be an object, got {params!r}")
    nested = sorted(name for name, value in params.items() if isinstance(value, dict))
    if nested:
        raise ValueError(
            f"config key '{where}.{nested[0]}': per-layer-type RoPE parameters are not supported"
        )
    type_key = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(type_key, "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"config key '{where}.{type_key}': {rope_type!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    if "rope_theta" in params:
        theta = _number(params["rope_theta"], f"{where}.rope_theta")
    else:
        theta = _number(cfg.get("rope_theta", DEFAULT_THETA), "rope_theta")
    fields: dict[str, Any] = dict(rope_type=rope_type, rope_theta=theta)
    if rope_type == "default":  # transformers' Llama ignores partial_rotary_factor here
        return fields
    partial_key = f"{where}.partial_rotary_factor"
    partial = params.get("partial_rotary_factor")
    if partial is None:
        partial_key, partial = "partial_rotary_factor", cfg.get("partial_rotary_factor")
    if partial is not None and partial != 1.0:
        raise ValueError(
            f"config key '{partial_key}': {partial!r} is not supported with rope_type "
            f"{rope_type!r} (the engine rotates the whole head)"
        )
    return fields | _scaled_fields(cfg, params, where, rope_type)
