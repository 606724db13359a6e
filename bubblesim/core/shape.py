"""`BatchShape`: what a cost model needs to know about one engine step.

Built from a scheduled batch by `bubblesim.core.policy` (sim and engine alike) and recorded in
every run's
steps.parquet, so `replay calibrate` can fit costs against exactly the fields the sim reads.
The field order is SHAPE_FIELDS, the steps.parquet column order and the positional order some
hot paths build shapes in (sim/fast/decode.py asserts it); a field added later is read as 0 from
run folders written before it (bubblesim.core.runfmt.io.ADDED_STEP_COLUMNS).

`shape_of` is the one statement of how a step's rows sum into its shape (`attn_pairs` the one of
a chunk's attention pairs); callers say what each row is (`ShapeRow`) from what they know: the
scheduler from its requests, the shapes sweep's grid from its synthetic rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import NamedTuple


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


def attn_pairs(start_pos: int, num_tokens: int) -> int:
    """(query, key) pairs of causal attention for `num_tokens` query tokens at positions
    `start_pos ..`: the token at position p attends to p + 1 keys."""
    return num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2


class ShapeRow(NamedTuple):
    """One request's share of a step: `num_tokens` query tokens after `start_pos` cached ones."""

    start_pos: int
    num_tokens: int
    is_prefill: bool
    num_drafts: int = 0  # draft tokens among a decode row's query tokens (prefill rows: none)
    is_new: bool = False  # a prefill row whose request is first scheduled this step
    history_tokens: int = 0  # output history its sampling reads (0 if it needs none)
    context_tokens: int = 0  # all tokens (prompt + output) its request holds


def shape_of(rows: Iterable[ShapeRow], finished_reqs: int = 0) -> BatchShape:
    """The shape of a step of `rows`: counts and sums over them, `max_kv_tokens` their maximum.
    Every row reads its cached keys and its own: `start_pos + num_tokens` KV tokens."""
    n = n_pf = pf_tok = dec_tok = drafts = kv = pairs = longest = hist = ctx = new = 0
    for r in rows:
        n += 1
        if r.is_prefill:
            n_pf += 1
            pf_tok += r.num_tokens
            new += r.is_new
        else:
            dec_tok += r.num_tokens
            drafts += r.num_drafts
        read = r.start_pos + r.num_tokens
        kv += read
        longest = max(longest, read)
        pairs += attn_pairs(r.start_pos, r.num_tokens)
        hist += r.history_tokens
        ctx += r.context_tokens
    return BatchShape(
        num_reqs=n,
        num_prefill_reqs=n_pf,
        prefill_tokens=pf_tok,
        decode_tokens=dec_tok,
        draft_tokens=drafts,
        kv_read_tokens=kv,
        attn_pairs=pairs,
        max_kv_tokens=longest,
        history_tokens=hist,
        context_tokens=ctx,
        new_reqs=new,
        finished_reqs=finished_reqs,
    )
