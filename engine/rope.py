"""RoPE cos/sin tables for each transformers `rope_type` (bubblesim.core.rope reads them from
config.json),
computed once per model in float64: the hot path only indexes the tables (engine.kernels.rope,
the fused KV-write and decode kernels, or `RotaryEmbedding.forward`).

Formulas follow transformers 5.x `modeling_rope_utils`. Two things are folded into the tables:
- yarn's attention factor (mscale) multiplies cos and sin, as transformers does;
- dynamic (NTK) scaling: transformers recomputes the base from the largest position id of each
  forward call (seq_len = max position + 1, at least max_position_embeddings). A position-indexed
  table cannot depend on the call, so row p uses seq_len = max(p + 1, max_position_embeddings).
  That is exactly transformers for every call within max_position_embeddings (plain RoPE) and for
  one-token decode steps past it (the step's query and the key it caches both use p + 1, so a
  prompt within max_position_embeddings generates the same tokens). It differs for a forward of
  several tokens that ends past max_position_embeddings (a long prefill, a prefill chunk, a
  verify step): transformers rotates all of that call's tokens, earlier ones included, with the
  base of its last position; here each token keeps its own row's base.
"""

from __future__ import annotations

import math

import torch

from bubblesim.core.models import ModelSpec


def _plain_inv_freq(theta: float | torch.Tensor, dim: int, device=None) -> torch.Tensor:
    """float64 [dim // 2] (or [rows, dim // 2] for a column of thetas): 1 / theta^(2i / dim)."""
    exponent = torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim
    return 1.0 / torch.as_tensor(theta, dtype=torch.float64, device=device) ** exponent


def _llama3(spec: ModelSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    factor, old_len = spec.rope_scaling_factor, spec.rope_original_max_context
    low, high = spec.rope_low_freq_factor, spec.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequency) are divided by factor, short kept, the middle blended
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(medium, blended, scaled)


def _yarn(spec: ModelSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    """Interpolated (divided by factor) below the correction range's low dimension, extrapolated
    (kept) above its high one, a linear ramp between."""
    dim, theta, old_len = spec.head_dim, spec.rope_theta, spec.rope_original_max_context

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(spec.rope_beta_fast), correction_dim(spec.rope_beta_slow)
    if spec.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    dims = torch.arange(dim // 2, dtype=torch.float64, device=inv_freq.device)
    ramp = ((dims - low) / (high - low)).clamp(0.0, 1.0)
    return inv_freq / spec.rope_scaling_factor * ramp + inv_freq * (1 - ramp)


def rope_inv_freq(spec: ModelSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """float64 [head_dim // 2] inverse frequencies at positions below any dynamic growth."""
    inv_freq = _plain_inv_freq(spec.rope_theta, spec.head_dim, device)
    if spec.rope_type == "linear":
        return inv_freq / spec.rope_scaling_factor
    if spec.rope_type == "llama3":
        return _llama3(spec, inv_freq)
    if spec.rope_type == "yarn":
        return _yarn(spec, inv_freq)
    return inv_freq  # default; dynamic below its max_position_embeddings


def _dynamic_angles(spec: ModelSpec, positions: torch.Tensor) -> torch.Tensor:
    """[P, head_dim // 2] angles with each row's NTK base (see the module docstring)."""
    dim, factor, max_len = spec.head_dim, spec.rope_scaling_factor, spec.rope_original_max_context
    seq_len = (positions + 1).clamp(min=max_len)
    base = spec.rope_theta * (factor * seq_len / max_len - (factor - 1)) ** (dim / (dim - 2))
    return positions[:, None] * _plain_inv_freq(base[:, None], dim, positions.device)


def rope_tables(
    spec: ModelSpec, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), float32 [max_positions, head_dim // 2], already times the attention factor."""
    positions = torch.arange(max_positions, dtype=torch.float64, device=device)
    if spec.rope_type == "dynamic":
        angles = _dynamic_angles(spec, positions)
    else:
        angles = positions[:, None] * rope_inv_freq(spec, device)[None, :]
    scale = spec.rope_attention_factor
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()
