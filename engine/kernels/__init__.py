"""Triton kernels. Importing this package imports triton; `engine.attention` imports it lazily,
only for the "triton" backend. On CPU the kernels run only under TRITON_INTERPRET=1, which must be
set before this package is first imported (triton.jit decides at decoration time)."""

from engine.kernels.activation import silu_mul
from engine.kernels.decode_attention import decode_attention
from engine.kernels.kv_cache_write import rope_write_kv, write_kv_cache
from engine.kernels.paged_attention import paged_attention
from engine.kernels.rms_norm import rms_norm
from engine.kernels.rope import rope_inplace
from engine.kernels.skinny_gemm import skinny_gemm
from engine.kernels.skinny_gemm import supports as skinny_supports

__all__ = [
    "decode_attention",
    "paged_attention",
    "rms_norm",
    "rope_inplace",
    "rope_write_kv",
    "silu_mul",
    "skinny_gemm",
    "skinny_supports",
    "write_kv_cache",
]
