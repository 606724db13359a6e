"""Reading RoPE settings from config.json (bubblesim.core.rope): both layouts give the same
ModelSpec, the
precedence rules of transformers 5, and one clear line naming the key for anything unsupported
or malformed. No transformers needed (tests/test_rope_hf.py checks the numbers against it)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from bubblesim.core.models import PRESETS, ModelSpec
from bubblesim.core.rope import rope_fields

SHAPES = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def spec_of(tmp_path, **cfg) -> ModelSpec:
    (tmp_path / "config.json").write_text(json.dumps(SHAPES | cfg))
    return ModelSpec.from_hf_config(tmp_path / "config.json", name="m")


def new_layout(rope: dict, theta: float = 5e5) -> dict:
    return {"rope_parameters": {**rope, "rope_theta": theta}}


def old_layout(rope: dict, theta: float = 5e5, type_key: str = "rope_type") -> dict:
    scaling = {(type_key if k == "rope_type" else k): v for k, v in rope.items()}
    return {
        "rope_theta": theta,
        "rope_scaling": None if rope["rope_type"] == "default" else scaling,
    }


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        LLAMA3,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
         "beta_fast": 8, "beta_slow": 2, "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5},
    ],
    ids=lambda r: r["rope_type"],
)  # fmt: skip
@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_both_layouts_give_the_same_spec(tmp_path, rope, type_key):
    new = spec_of(tmp_path, **new_layout(rope))
    assert new == spec_of(tmp_path, **old_layout(rope, type_key=type_key))
    assert new.rope_type == rope["rope_type"] and new.rope_theta == 5e5
    assert new.rope_scaling_factor == rope.get("factor", 0.0)


def test_fields_of_each_type(tmp_path):
    assert spec_of(tmp_path, **new_layout(LLAMA3)) == replace(
        spec_of(tmp_path, **new_layout({"rope_type": "default"})),
        rope_type="llama3",
        rope_scaling_factor=8.0,
        rope_original_max_context=32,
    )
    # dynamic grows past max_position_embeddings, which max_model_len must not move
    dynamic = spec_of(tmp_path, **new_layout({"rope_type": "dynamic", "factor": 2.0}))
    assert dynamic.rope_original_max_context == 128
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    y = spec_of(tmp_path, **new_layout(yarn))
    assert (y.rope_beta_fast, y.rope_beta_slow, y.rope_truncate) == (32.0, 1.0, True)
    assert y.rope_attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    y = spec_of(tmp_path, **new_layout(yarn | {"mscale": 0.9, "mscale_all_dim": 0.4}))
    m = 0.1 * math.log(4.0)
    assert y.rope_attention_factor == pytest.approx((0.9 * m + 1) / (0.4 * m + 1))
    y = spec_of(tmp_path, **new_layout(yarn | {"attention_factor": 1.5, "mscale": 0.9}))
    assert y.rope_attention_factor == 1.5
    # a null factor is max_position_embeddings / original (DeepSeek-V3's convention)
    y = spec_of(tmp_path, **new_layout(yarn | {"factor": None}))
    assert y.rope_scaling_factor == 4.0


def test_transformers_precedence(tmp_path):
    """Non-empty rope_scaling over rope_parameters; the dict's rope_theta over the top-level one;
    a top-level original_max_position_embeddings over the dict's; 10000 when none is given."""
    both = spec_of(tmp_path, rope_scaling=LLAMA3, rope_parameters={"rope_type": "default"})
    assert both.rope_type == "llama3"
    s = spec_of(
        tmp_path, rope_theta=1.0, rope_parameters={"rope_type": "default", "rope_theta": 7.0}
    )
    assert s.rope_theta == 7.0
    s = spec_of(tmp_path, original_max_position_embeddings=64, **new_layout(LLAMA3))
    assert s.rope_original_max_context == 64
    assert spec_of(tmp_path).rope_theta == 10_000.0
    assert spec_of(tmp_path, rope_scaling=None, rope_theta=3.0).rope_type == "default"
    # transformers' Llama ignores partial_rotary_factor for plain RoPE
    assert spec_of(tmp_path, partial_rotary_factor=0.5).rope_type == "default"


def test_head_dim_null_is_hidden_over_heads(tmp_path):
    assert spec_of(tmp_path, head_dim=None).head_dim == 8
    assert spec_of(tmp_path, head_dim=12).head_dim == 12


@pytest.mark.parametrize(
    "cfg,message",
    [
        (new_layout({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}),
         r"config key 'rope_parameters.rope_type': 'longrope' is not supported "
         r"\(supported: default, linear, dynamic, llama3, yarn\)"),
        ({"rope_scaling": {"type": "su", "factor": 2.0}},
         r"config key 'rope_scaling.type': 'su' is not supported"),
        (new_layout({"rope_type": "dynamic_yarn", "factor": 2.0}),
         r"'rope_parameters.rope_type': 'dynamic_yarn' is not supported"),
        (new_layout({"rope_type": "linear"}),
         r"config key 'rope_parameters.factor': missing \(rope_type 'linear' needs it\)"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}},
         r"config key 'rope_scaling.factor': must be a positive number, got '2'"),
        (new_layout({"rope_type": "dynamic", "factor": 0}),
         r"config key 'rope_parameters.factor': must be a positive number, got 0"),
        (new_layout({k: v for k, v in LLAMA3.items() if k != "high_freq_factor"}),
         r"config key 'rope_parameters.high_freq_factor': missing \(rope_type 'llama3' needs it\)"),
        (new_layout(LLAMA3 | {"original_max_position_embeddings": 16.5}),
         r"config key 'rope_parameters.original_max_position_embeddings': must be a positive "
         r"integer, got 16.5"),
        (new_layout({"rope_type": "yarn", "factor": 2.0, "truncate": "yes"}),
         r"config key 'rope_parameters.truncate': must be true or false, got 'yes'"),
        (new_layout({"rope_type": "yarn", "factor": 2.0, "attention_factor": -1.0}),
         r"config key 'rope_parameters.attention_factor': must be a positive number, got -1.0"),
        (new_layout({"rope_type": "yarn", "factor": 2.0, "mscale": "x", "mscale_all_dim": 1}),
         r"config key 'rope_parameters.mscale': must be a number, got 'x'"),
        (new_layout({"rope_type": "yarn"}),
         r"config key 'rope_parameters.factor': missing \(rope_type 'yarn' needs it\)"),
        ({"rope_parameters": [1, 2]},
         r"config key 'rope_parameters': must be an object, got \[1, 2\]"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}},
         r"config key 'rope_parameters.full_attention': per-layer-type RoPE parameters are not "
         r"supported"),
        (new_layout({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
         r"config key 'rope_parameters.partial_rotary_factor': 0.5 is not supported with "
         r"rope_type 'linear'"),
        ({"partial_rotary_factor": 0.25, **old_layout({"rope_type": "linear", "factor": 2.0})},
         r"config key 'partial_rotary_factor': 0.25 is not supported"),
        ({"rope_theta": None},
         r"config key 'rope_theta': must be a positive number, got None"),
        (new_layout({"rope_type": "default"}, theta=-1.0),
         r"config key 'rope_parameters.rope_theta': must be a positive number, got -1.0"),
        ({"max_position_embeddings": "long", **new_layout({"rope_type": "dynamic", "factor": 2.0})},
         r"config key 'max_position_embeddings': must be a positive integer, got 'long'"),
    ],
)  # fmt: skip
def test_unsupported_or_malformed_rope_is_refused_in_one_line(tmp_path, cfg, message):
    with pytest.raises(ValueError, match=message) as err:
        spec_of(tmp_path, **cfg)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"checkpoint config '{tmp_path / 'config.json'}': config key")


def test_loader_refuses_before_reading_weights(tmp_path):
    pytest.importorskip("torch")
    from engine.loader import load_checkpoint

    (tmp_path / "config.json").write_text(
        json.dumps(SHAPES | new_layout({"rope_type": "longrope", "factor": 2.0}))
    )
    with pytest.raises(ValueError, match="'rope_parameters.rope_type': 'longrope'"):
        load_checkpoint(tmp_path, device="cpu")


def test_spec_rope_type_is_checked():
    tiny = PRESETS["tiny"]
    assert PRESETS["llama3-8b"].rope_type == "llama3" and tiny.rope_type == "default"
    with pytest.raises(ValueError, match="rope_type 'longrope' is not one of"):
        replace(tiny, rope_type="longrope", rope_scaling_factor=2.0)
    with pytest.raises(
        ValueError, match="rope_scaling_factor 8.0 does not fit rope_type 'default'"
    ):
        replace(tiny, rope_scaling_factor=8.0)  # the old implicit llama3
    with pytest.raises(ValueError, match="does not fit rope_type 'linear'"):
        replace(tiny, rope_type="linear")


def test_rope_fields_alone():
    assert rope_fields({}) == {"rope_type": "default", "rope_theta": 10_000.0}
