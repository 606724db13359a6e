"""The CPU n-gram proposer (the "before" of seed 4): bubblesim.core.ngram.propose over each
request's CPU
token list. It needs a step's sampled tokens on the host before it can propose for the next step,
so an engine that uses it runs synchronously (one batch in flight), as vLLM does for `ngram`.

Token lists (vLLM's `token_ids_cpu`): `start` when a request gets a slot (prompt + confirmed
outputs), `extend` with the tokens each step emits, `drop` when it leaves. Proposing costs time
growing with the context (a Python scan back over the list per n).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bubblesim.core.ngram import propose


class NgramProposerCPU:
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.tokens: dict[int, list[int]] = {}  # request index -> known tokens (looked up only)

    def start(self, index: int, token_ids: np.ndarray) -> None:
        self.tokens[index] = token_ids.tolist()

    def extend(self, index: int, new: Sequence[int]) -> None:
        self.tokens[index].extend(new)

    def drop(self, index: int) -> None:
        self.tokens.pop(index, None)

    def propose(self, index: int) -> list[int]:
        """Up to k drafts continuing the request's known tokens."""
        return propose(self.tokens[index], self.k, self.min_n, self.max_n)
