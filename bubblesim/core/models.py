"""Model shape presets (Llama family), shared by the engine (shapes, random weights) and the
simulator's roofline (bytes and FLOPs). A checkpoint folder's config.json maps onto the same
fields (`ModelSpec.from_hf_config`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bubblesim.core.config import ConfigError
from bubblesim.core.rope import ROPE_TYPES, rope_fields

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_context: int  # tokens (max_position_embeddings)
    rope_theta: float = 500_000.0
    # RoPE as transformers' rope_type (bubblesim.core.rope.ROPE_TYPES; engine.rope computes the
    # tables).
    # factor: linear/dynamic/llama3/yarn (0 exactly when default); low/high freq factor: llama3;
    # original ctx: llama3/yarn pretraining length, dynamic's max_position_embeddings (the NTK
    # base grows past it); beta_fast/slow, truncate: yarn; attention factor: yarn's cos/sin scale
    rope_type: str = "default"
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_context: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model '{self.name}': rope_type {self.rope_type!r} is not one of "
                             f"{', '.join(ROPE_TYPES)}")  # fmt: skip
        if (self.rope_type == "default") != (self.rope_scaling_factor == 0):
            raise ValueError(
                f"model '{self.name}': rope_scaling_factor {self.rope_scaling_factor} does not "
                f"fit rope_type {self.rope_type!r} (0 exactly when 'default')"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    # ---- tensor parallelism (Megatron layout: q/k/v and gate/up split by columns, o and down
    # by rows, vocab-parallel embedding and LM head; norms replicated; KV heads split across
    # ranks, replicated when there are more ranks than KV heads, as vLLM does) -------------
    def tp_error(self, tp: int) -> str | None:
        """Why this model cannot be split `tp` ways, or None."""
        if tp == 1:
            return None
        if self.num_heads % tp:
            return f"{self.num_heads} attention heads do not split {tp} ways"
        kvh = self.num_kv_heads
        if kvh % tp and tp % kvh:
            return f"{kvh} KV heads neither split {tp} ways nor replicate evenly"
        if self.intermediate_size % tp:
            return f"MLP width {self.intermediate_size} does not split {tp} ways"
        return None

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        return max(1, self.num_kv_heads // tp)

    def vocab_per_rank(self, tp: int = 1) -> int:
        """Rows of the embedding / LM head shard (the vocabulary padded to a multiple of tp)."""
        return -(-self.vocab_size // tp)

    def params_per_rank(self, tp: int = 1) -> int:
        """Parameters one rank holds; `num_params` at tp 1."""
        if tp == 1:
            return self.num_params
        h, d = self.hidden_size, self.head_dim
        q = self.q_size // tp
        kv = self.kv_heads_per_rank(tp) * d
        attn = h * (q + 2 * kv) + q * h
        mlp = 3 * h * (self.intermediate_size // tp)
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_per_rank(tp) * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def weight_bytes(self, dtype: str = "bfloat16", tp: int = 1) -> int:
        """Weight bytes on one GPU of a `tp`-way replica (the whole model at tp 1)."""
        return self.params_per_rank(tp) * DTYPE_BYTES[dtype]

    def decode_weight_bytes(self, dtype: str = "bfloat16", tp: int = 1) -> int:
        """Bytes of weights one forward pass reads on one rank: all but the input embedding
        table (a gather)."""
        unread = 0 if self.tie_word_embeddings else self.vocab_per_rank(tp) * self.hidden_size
        return (self.params_per_rank(tp) - unread) * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str = "bfloat16", tp: int = 1) -> int:
        """KV cache bytes per token on one rank (its KV heads; the whole cache at tp 1)."""
        kv = self.kv_size if tp == 1 else self.kv_heads_per_rank(tp) * self.head_dim
        return 2 * self.num_layers * kv * DTYPE_BYTES[dtype]

    def flops_per_token(self) -> int:
        """Matmul FLOPs per token, excluding attention over the context (2 * params read)."""
        return 2 * (
            self.num_params
            - self.vocab_size * self.hidden_size * (0 if self.tie_word_embeddings else 1)
        )

    def attn_flops(self, query_tokens: int, context_tokens: int) -> int:
        """QK^T and PV FLOPs for `query_tokens` attending to `context_tokens` each."""
        return 4 * self.num_layers * self.q_size * query_tokens * context_tokens

    @staticmethod
    def from_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
        cfg = json.loads(Path(path).read_text())
        try:
            heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            return ModelSpec(
                name=name or str(Path(path).parent.name),
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or hidden // heads,
                intermediate_size=cfg["intermediate_size"],
                max_context=cfg.get("max_position_embeddings", 8192),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                **rope_fields(cfg),
            )
        except KeyError as e:
            raise ValueError(f"checkpoint config '{path}': missing key {e.args[0]!r}") from None
        except ValueError as e:
            raise ValueError(f"checkpoint config '{path}': {e}") from None


_LLAMA31_ROPE: dict[str, Any] = dict(
    rope_type="llama3",
    rope_theta=500_000.0,
    rope_scaling_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_context=8192,
)

# Shapes from the public Hugging Face config.json of each model. `llama3-8b` and `llama3-70b` use
# the Llama-3.1 shapes (128k context, RoPE scaling), so long-output seed scenarios fit.
PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny",
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_context=131_072,
        rope_theta=10_000.0,
    ),
    "small": ModelSpec(  # a CPU-testable model with a real vocabulary size, for replay tests
        name="small",
        vocab_size=4096,
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=768,
        max_context=131_072,
        rope_theta=10_000.0,
    ),
    "llama3.2-1b": ModelSpec(
        name="llama3.2-1b",
        vocab_size=128_256,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        max_context=131_072,
        tie_word_embeddings=True,
        **{**_LLAMA31_ROPE, "rope_scaling_factor": 32.0},
    ),
    "llama3.2-3b": ModelSpec(
        name="llama3.2-3b",
        vocab_size=128_256,
        hidden_size=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=8192,
        max_context=131_072,
        tie_word_embeddings=True,
        **{**_LLAMA31_ROPE, "rope_scaling_factor": 32.0},
    ),
    "llama3-8b": ModelSpec(
        name="llama3-8b",
        vocab_size=128_256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14_336,
        max_context=131_072,
        **_LLAMA31_ROPE,
    ),
    "llama3-70b": ModelSpec(
        name="llama3-70b",
        vocab_size=128_256,
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28_672,
        max_context=131_072,
        **_LLAMA31_ROPE,
    ),
}


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or the shapes of a checkpoint folder (its config.json)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    p = Path(name_or_path)
    if (p / "config.json").is_file():
        return ModelSpec.from_hf_config(p / "config.json", name=p.name)
    raise ConfigError(
        f"config key 'model': '{name_or_path}' is neither a preset {sorted(PRESETS)} "
        "nor a folder with config.json"
    )


def with_context(spec: ModelSpec, max_model_len: int) -> ModelSpec:
    return spec if max_model_len <= 0 else replace(spec, max_context=max_model_len)
