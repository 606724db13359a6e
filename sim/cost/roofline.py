"""Analytic GPU pass time: a roofline of the model's bytes and FLOPs on the GPU's datasheet
ceilings, scaled by efficiency factors (in the spirit of nanoGPT's `estimate_mfu`).

One pass = the forward over the step's query tokens plus the logits/sampling traffic:
  bytes = weights read once + KV read (kv_read_tokens) + KV written (num_tokens) + logits rows
  flops = 2 * body params * num_tokens + 2 * lm_head params * rows + attention (attn_pairs)
  time  = (mem^p + compute^p)^(1/p) + overhead, floored at a launch-bound minimum
where rows = sampled logits rows = decode_tokens + num_prefill_reqs (a prefill chunk samples at
most one row; the lm_head runs only on sampled rows).
It reads no `max_kv_tokens`: bytes and FLOPs follow the batch's sums. How long the longest
context's attention programs straggle behind the rest is a kernel-scheduling effect, left to
fitted `gpu_pass` models (a `max_kv_tokens` term), not to the roofline.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from bubblesim.core.gpus import GPUSpec
from bubblesim.core.models import DTYPE_BYTES, ModelSpec
from bubblesim.core.shape import BatchShape

# float32 matmuls run as TF32 on tensor cores, at half the bf16 rate (H100/A100/L40S sheets).
DTYPE_RATE = {"bfloat16": 1.0, "float16": 1.0, "float32": 0.5}
_COUNTS = {"prefill_tokens", "decode_tokens", "num_prefill_reqs"}  # what `keyed` folds in


class Roofline:
    """`Roofline(model, gpu, dtype, params)(shape)` -> ms; all constants folded at init."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        dtype: str,
        params: Mapping[str, Any],
        tp: int = 1,
    ):
        """`tp`: the pass of one rank of a tensor-parallel replica (its weight shard, its KV
        heads, 1/tp of the matmul and attention FLOPs; logits and sampling over the whole
        vocabulary, as every rank samples); the collectives are sim.cost.collective's."""
        dbytes = DTYPE_BYTES[dtype]
        ms_per_byte = 1e3 / (gpu.hbm_gb_per_s * 1e9 * params["mem_efficiency"])
        flop_rate = gpu.bf16_tflops * 1e12 * DTYPE_RATE[dtype]
        ms_per_mm_flop = 1e3 / (flop_rate * params["matmul_efficiency"])
        ms_per_attn_flop = 1e3 / (flop_rate * params["attn_efficiency"])
        lm_params = model.vocab_per_rank(tp) * model.hidden_size
        weight_bytes = model.decode_weight_bytes(dtype, tp)
        body_params = weight_bytes // dbytes - lm_params
        layers = model.num_layers
        attn_flops = model.attn_flops(1, 1) if tp == 1 else model.attn_flops(1, 1) / tp

        self.weights_ms = weight_bytes * ms_per_byte
        self.kv_ms_per_token = model.kv_bytes_per_token(dtype, tp) * ms_per_byte
        self.logits_ms_per_row = model.vocab_size * params["logits_bytes_per_vocab"] * ms_per_byte
        self.body_ms_per_token = 2 * body_params * ms_per_mm_flop
        self.lm_ms_per_row = 2 * lm_params * ms_per_mm_flop
        self.attn_ms_per_pair = attn_flops * ms_per_attn_flop
        self.p = float(params["pnorm"])
        self.inv_p = 1.0 / self.p
        self.overhead_ms = params["overhead_ms"] + params["overhead_ms_per_layer"] * layers
        self.min_ms = params["min_ms"] + params["min_ms_per_layer"] * layers

    def memory_ms(self, s: BatchShape) -> float:
        tokens = s.prefill_tokens + s.decode_tokens
        rows = s.decode_tokens + s.num_prefill_reqs
        return (
            self.weights_ms
            + self.kv_ms_per_token * (s.kv_read_tokens + tokens)
            + self.logits_ms_per_row * rows
        )

    def compute_ms(self, s: BatchShape) -> float:
        tokens = s.prefill_tokens + s.decode_tokens
        rows = s.decode_tokens + s.num_prefill_reqs
        return (
            self.body_ms_per_token * tokens
            + self.lm_ms_per_row * rows
            + self.attn_ms_per_pair * s.attn_pairs
        )

    def __call__(self, s: BatchShape) -> float:
        # Inlined memory_ms/compute_ms: this runs for every simulated step.
        tokens = s.prefill_tokens + s.decode_tokens
        rows = s.decode_tokens + s.num_prefill_reqs
        mem = (
            self.weights_ms
            + self.kv_ms_per_token * (s.kv_read_tokens + tokens)
            + self.logits_ms_per_row * rows
        )
        cmp = (
            self.body_ms_per_token * tokens
            + self.lm_ms_per_row * rows
            + self.attn_ms_per_pair * s.attn_pairs
        )
        p = self.p
        t = (mem**p + cmp**p) ** self.inv_p + self.overhead_ms
        return t if t > self.min_ms else self.min_ms

    def keyed(self, s: Any, fixed: Collection[str]) -> Callable[[Any], float]:
        """`self` for the shapes whose `fixed` fields are `s`'s (sim.stepcosts.StepCosts.const
        takes it for a run of decode steps): with the token and row counts (prefill_tokens,
        decode_tokens, num_prefill_reqs) fixed, every term of those folded in, so it reads
        only kv_read_tokens and attn_pairs; the same float operations in the same order as
        `__call__`, so the same value to the bit. Else `self`."""
        if not set(fixed) >= _COUNTS:
            return self
        tokens = s.prefill_tokens + s.decode_tokens
        rows = s.decode_tokens + s.num_prefill_reqs
        weights_ms, kv_ms = self.weights_ms, self.kv_ms_per_token
        logits_ms = self.logits_ms_per_row * rows
        fixed_cmp = self.body_ms_per_token * tokens + self.lm_ms_per_row * rows
        attn_ms = self.attn_ms_per_pair
        p, inv_p, overhead_ms, min_ms = self.p, self.inv_p, self.overhead_ms, self.min_ms

        def decode_ms(s: Any) -> float:
            mem = weights_ms + kv_ms * (s.kv_read_tokens + tokens) + logits_ms
            cmp = fixed_cmp + attn_ms * s.attn_pairs
            t = (mem**p + cmp**p) ** inv_p + overhead_ms
            return t if t > min_ms else min_ms

        return decode_ms
