"""A request's scheduling state: integers only, shared by the engine and the simulator.

Token accounting (all counts in tokens):
- `num_tokens` = prompt_len + num_output_tokens + num_placeholders: every token whose value is
  known or will be known once the batches in flight complete.
- `num_computed_tokens`: positions whose KV is written by a launched batch. State advances at
  launch, so while batches are in flight this is an upper bound (drafts assumed accepted) and is
  rewound by the rejected drafts when results arrive.
- Invariant: 0 <= num_computed_tokens <= num_tokens, and num_output_tokens <= output_len.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from enum import IntEnum


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Request:
    __slots__ = (
        "index",
        "request_id",
        "arrival_s",
        "prompt_len",
        "output_len",
        "needs_history",
        "prefix_id",
        "prefix_len",
        "prompt_ids",
        "status",
        "num_computed_tokens",
        "num_output_tokens",
        "num_placeholders",
        "num_inflight_gen",
        "num_inflight_batches",
        "block_ids",
        "block_hashes",
        "num_cached_tokens",
        "num_preemptions",
        "num_accepted_drafts",
        "draft_hint",
    )

    def __init__(
        self,
        index: int,
        request_id: Hashable,
        arrival_s: float,
        prompt_len: int,
        output_len: int,
        needs_history: bool = False,
        prefix_id: Hashable | None = None,
        prefix_len: int = 0,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self.index = index  # row in the trace: a dense id for per-request arrays
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.needs_history = needs_history
        self.prefix_id = prefix_id
        self.prefix_len = prefix_len if prefix_id is not None else 0
        self.prompt_ids = prompt_ids
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0  # confirmed: results applied
        self.num_placeholders = 0  # output slots of in-flight batches (1 + drafts each)
        self.num_inflight_gen = 0  # in-flight batches that will emit >= 1 token for this request
        self.num_inflight_batches = 0  # in-flight batches holding this request at all
        self.block_ids: list[int] = []
        self.block_hashes: list[int] | None = None  # lazily computed prefix-cache keys
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (last admission)
        self.num_preemptions = 0
        self.num_accepted_drafts = 0
        self.draft_hint: int | None = None  # drafts the proposer has for the next step; None = k

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output_tokens + self.num_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def in_decode(self) -> bool:
        """Past its prefill: the next step feeds one (known or placeholder) token."""
        has_output = self.num_output_tokens + self.num_placeholders > 0
        return has_output and self.num_tokens - self.num_computed_tokens == 1

    @property
    def outputs_guaranteed(self) -> int:
        """Output tokens certain to exist once in-flight batches complete (>= 1 each)."""
        return self.num_output_tokens + self.num_inflight_gen

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}, out={self.num_output_tokens}/{self.output_len}, "
            f"ph={self.num_placeholders}, blocks={len(self.block_ids)})"
        )
