"""`BatchShape`: what a cost model needs to know about one engine step.

Built from a scheduled batch by `core.policy` (sim and engine alike) and recorded in every run's
steps.parquet, so `replay calibrate` can fit costs against exactly the fields the sim reads.
The field order is SHAPE_FIELDS, the steps.parquet column order and the positional order some
hot paths build shapes in (sim/fast/decode.py asserts it); a field added later is read as 0 from
run folders written before it (core.runfmt.io.ADDED_STEP_COLUMNS).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class BatchShape:
    num_reqs: int = 0  # requests in the batch
    num_prefill_reqs: int = 0  # of which are (chunked) prefills
    prefill_tokens: int = 0  # query tokens of prefill chunks
    decode_tokens: int = 0  # query tokens of decodes: 1 per decode request + its drafts
    draft_tokens: int = 0  # of decode_tokens, draft (speculative) tokens being verified
    kv_read_tokens: int = 0  # sum over requests of context length read by attention (KV bytes)
    attn_pairs: int = 0  # sum over query tokens of keys attended (attention FLOPs)
    max_kv_tokens: int = 0  # longest context read by attention in the batch: max over requests
    # of (start_pos + num_tokens); the split attention kernel's stragglers follow it
    history_tokens: int = 0  # sum of output history of requests whose sampling needs it
    context_tokens: int = 0  # sum of all tokens (prompt + output) held by the batch's requests
    new_reqs: int = 0  # requests first scheduled this step (input-batch updates)
    finished_reqs: int = 0  # requests that finished in the step's results

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def is_pure_decode(self) -> bool:
        return self.num_prefill_reqs == 0 and self.num_reqs > 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


SHAPE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(BatchShape))
