"""How many tokens each entry of a completed batch emits (1 + accepted drafts).

Exact when the trace has token ids: the same n-gram proposer the engine runs is applied to the
trace's text and its drafts are compared with the tokens that really follow (forced decoding).
Otherwise per-draft-position acceptance with probability `accept_rate` (the trace column, or
`default_rate`), drawn from a per-request seeded stream so runs are deterministic.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from bubblesim.core.config import SpecConfig
from bubblesim.core.ngram import accepted_prefix, propose
from bubblesim.core.policy import ScheduledBatch
from bubblesim.core.request import Request


class AcceptanceModel:
    def __init__(
        self,
        spec: SpecConfig,
        seed: int,
        token_ids: Sequence[tuple[Sequence[int], Sequence[int]] | None] | None = None,
        accept_rate: Sequence[float] | None = None,
        default_rate: float = 0.0,
    ) -> None:
        self.spec = spec
        self.seed = seed
        self.token_ids = token_ids  # per request index: (prompt_ids, output_ids) or None
        self.accept_rate = accept_rate
        self.default_rate = default_rate
        self._streams: dict[int, tuple[Callable[[], float], float]] = {}

    def emitted(self, batch: ScheduledBatch) -> list[int]:
        out = []
        for e in batch.entries:
            if not e.generates or e.num_drafts == 0:
                out.append(1)
            else:
                out.append(1 + self.accepted(e.req, e.num_drafts))
        return out

    def accepted(self, req: Request, k: int) -> int:
        """Drafts of the entry completing now. Batches complete in order, so the request's
        confirmed outputs are exactly those before this step: the drafts were proposed (on the
        GPU, or on the CPU in sync mode) from that true context, whatever positions the CPU
        assumed optimistically when it scheduled the entry with earlier batches in flight."""
        ids = self.token_ids[req.index] if self.token_ids is not None else None
        if ids is not None:
            done = req.num_output_tokens  # outputs known before this step's tokens
            drafts = self.drafts_at(req, req.prompt_len + done)[:k]
            prompt, output = ids
            return accepted_prefix(drafts, output[done : done + k])
        draw, rate = self.stream(req.index)
        n = 0
        while n < k and draw() < rate:
            n += 1
        return n

    def stream(self, index: int) -> tuple[Callable[[], float], float]:
        """Request `index`'s seeded stream (its `random()`) and per-draft acceptance rate, for
        traces without token ids: entry j accepts its i-th draft while draw() < rate."""
        got = self._streams.get(index)
        if got is None:
            rate = self.default_rate
            if self.accept_rate is not None:
                rate = float(self.accept_rate[index])
            got = self._streams[index] = (
                random.Random(self.seed * 1_000_003 + index).random,
                rate,
            )
        return got

    def drafts_at(self, req: Request, context_len: int) -> list[int]:
        """n-gram drafts proposed from the first `context_len` tokens of the request's text."""
        assert self.token_ids is not None
        ids = self.token_ids[req.index]
        assert ids is not None
        prompt, output = ids
        ctx = list(prompt[:context_len]) + list(output[: max(0, context_len - len(prompt))])
        return propose(ctx, self.spec.k, self.spec.min_n, self.spec.max_n)

    def has_ids(self, req: Request) -> bool:
        return self.token_ids is not None and self.token_ids[req.index] is not None
