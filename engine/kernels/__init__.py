"""Triton kernels. Importing this package imports triton; `engine.attention` imports it lazily,
only for the "triton" backend. On CPU the kernels run only under TRITON_INTERPRET=1, which must be
set before this package is first imported (triton.jit decides at decoration time)."""

from engine.kernels.kv_cache_write import write_kv_cache
from engine.kernels.paged_attention import paged_attention
from engine.kernels.rms_norm import rms_norm
from engine.kernels.rope import rope_inplace

__all__ = ["paged_attention", "rms_norm", "rope_inplace", "write_kv_cache"]
