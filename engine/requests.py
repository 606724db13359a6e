"""Per-request token state of the engine, and what a caller gets back.

The scheduling state of a request (counts, blocks, status) lives in
`bubblesim.core.request.Request`, shared
with the simulator; this file adds what only the real engine needs: token ids, the CPU output list
with -1 placeholders for tokens still on the GPU, the request's slot in the per-slot GPU buffers,
and timestamps.

Invariants of a running `RequestState` (checked by tests):
- `output` = confirmed tokens, then one -1 placeholder per in-flight generating batch (filled in
  place, front to back, as results arrive); len(output) == req.num_output_tokens +
  req.num_placeholders.
- `token_ids[:prompt_len + req.num_output_tokens]` are the known tokens (a recompute after
  preemption reads them); later entries are undefined.
- `slot` >= 0 exactly while the request is running (slots are taken on the first batch after
  admission and given back on preemption or finish).
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bubblesim.core.request import Request
from bubblesim.core.trace import Trace

IntIds = Sequence[int] | np.ndarray


@dataclass(frozen=True)
class RequestInput:
    """One request as a caller hands it to the engine (a trace row)."""

    request_id: Hashable
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0
    prompt_ids: IntIds | None = None  # None = synthesised from (seed, prefix, index)
    output_ids: IntIds | None = None  # forced decoding: the engine emits exactly these
    needs_history: bool = False  # sampling uses the output history (penalties)
    prefix_id: Hashable | None = None
    prefix_len: int = 0


@dataclass
class RequestOutput:
    """A finished request. Times are `time.perf_counter_ns()` on the engine host."""

    request_id: Hashable
    token_ids: list[int]
    arrival_ns: int
    first_token_ns: int
    finish_ns: int
    token_ns: list[int] = field(default_factory=list)  # emission time of each output token
    num_preemptions: int = 0


class RequestState:
    __slots__ = (
        "req",
        "key",
        "token_ids",
        "forced",
        "output",
        "slot",
        "arrival_ns",
        "first_token_ns",
        "finish_ns",
        "token_ns",
    )

    def __init__(
        self, req: Request, key: int, prompt_ids: np.ndarray, forced: np.ndarray | None
    ) -> None:
        self.req = req
        self.key = key  # seeds the request's synthetic prompt and sampling noise
        self.token_ids = np.zeros(req.prompt_len + req.output_len, dtype=np.int32)
        self.token_ids[: req.prompt_len] = prompt_ids
        self.forced = forced  # int32 [output_len] or None
        self.output: list[int] = []
        self.slot = -1
        self.arrival_ns = 0
        self.first_token_ns = -1
        self.finish_ns = -1
        self.token_ns: list[int] = []

    @property
    def prompt_ids(self) -> np.ndarray:
        return self.token_ids[: self.req.prompt_len]

    def confirmed_outputs(self) -> np.ndarray:
        p = self.req.prompt_len
        return self.token_ids[p : p + self.req.num_output_tokens]

    def apply(self, token: int, now_ns: int) -> None:
        """A result arrived for the oldest in-flight generating batch (call before
        `Scheduler.complete`, which advances `num_output_tokens`)."""
        i = self.req.num_output_tokens
        self.output[i] = token
        self.token_ids[self.req.prompt_len + i] = token
        self.token_ns.append(now_ns)
        if self.first_token_ns < 0:
            self.first_token_ns = now_ns

    def apply_many(self, tokens: list[int], now_ns: int) -> None:
        """`apply` for the tokens one verification step emitted (accepted drafts + 1)."""
        i = self.req.num_output_tokens
        n = len(tokens)
        self.output[i : i + n] = tokens
        p = self.req.prompt_len + i
        self.token_ids[p : p + n] = tokens
        self.token_ns.extend([now_ns] * n)
        if self.first_token_ns < 0:
            self.first_token_ns = now_ns

    def result(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.req.request_id,
            token_ids=list(self.output),
            arrival_ns=self.arrival_ns,
            first_token_ns=self.first_token_ns,
            finish_ns=self.finish_ns,
            token_ns=self.token_ns,
            num_preemptions=self.req.num_preemptions,
        )


class SlotPool:
    """Dense slot ids 0..n-1 for running requests; lowest free id first (deterministic)."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))  # a heap

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("no free request slot: more running requests than max_num_seqs")
        return heapq.heappop(self.free)

    def give(self, slot: int) -> None:
        heapq.heappush(self.free, slot)


# ---- building requests --------------------------------------------------------------------------


def _stable_key(x: Hashable) -> int:
    """A process-independent integer for an id (Python's str hash is salted per process)."""
    if isinstance(x, int | np.integer):
        return int(x) & 0x7FFFFFFF
    return zlib.crc32(repr(x).encode())


def synth_prompt(
    seed: int, index: int, prompt_len: int, vocab: int, prefix_id: Hashable | None, prefix_len: int
) -> np.ndarray:
    """Deterministic random prompt ids; the first `prefix_len` depend only on the prefix id, so
    requests of one prefix group share them (their KV blocks may be shared by prefix caching)."""
    ids = np.random.default_rng([seed, 1, index]).integers(0, vocab, prompt_len, dtype=np.int32)
    if prefix_id is not None and prefix_len > 0:
        n = min(prefix_len, prompt_len)
        rng = np.random.default_rng([seed, 2, _stable_key(prefix_id)])
        ids[:n] = rng.integers(0, vocab, n, dtype=np.int32)
    return ids


def check_ids(name: str, rid: Hashable, ids: IntIds, length: int, vocab: int) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64)
    if arr.shape != (length,):
        raise ValueError(f"request {rid!r}: {name} has {arr.size} ids, expected {length}")
    if length and (arr.min() < 0 or arr.max() >= vocab):
        raise ValueError(f"request {rid!r}: {name} has an id outside the vocabulary 0..{vocab - 1}")
    return arr.astype(np.int32)


def make_state(inp: RequestInput, index: int, key: int, seed: int, vocab: int) -> RequestState:
    """Validate a request and build its state; `key` seeds a synthetic prompt. Prompt ids go to
    the policy (prefix-cache keys) only when given, as the simulator does."""
    rid = inp.request_id
    if inp.prompt_len < 1 or inp.output_len < 1:
        raise ValueError(f"request {rid!r}: prompt_len and output_len must be >= 1")
    if inp.prompt_ids is not None:
        prompt = check_ids("prompt_ids", rid, inp.prompt_ids, inp.prompt_len, vocab)
    else:
        prompt = synth_prompt(seed, key, inp.prompt_len, vocab, inp.prefix_id, inp.prefix_len)
    forced = None
    if inp.output_ids is not None:
        forced = check_ids("output_ids", rid, inp.output_ids, inp.output_len, vocab)
    req = Request(
        index,
        rid,
        inp.arrival_s,
        inp.prompt_len,
        inp.output_len,
        needs_history=inp.needs_history,
        prefix_id=inp.prefix_id,
        prefix_len=inp.prefix_len,
        prompt_ids=prompt.tolist() if inp.prompt_ids is not None else None,
    )
    return RequestState(req, key, prompt, forced)


def inputs_from_trace(trace: Trace) -> list[RequestInput]:
    """Trace rows in arrival order (stable), as the simulator builds its requests."""
    pg, pk, pl = trace.prefix_group, trace.prefix_keys, trace.prefix_len
    hist = trace.history_mask()
    out = []
    for row in trace.arrival_order().tolist():
        prefix_id: Hashable | None = None
        prefix_len = 0
        if pg is not None and pk is not None and pl is not None and pg[row] >= 0:
            key = pk[pg[row]]
            prefix_id = key.item() if isinstance(key, np.generic) else key
            prefix_len = int(pl[row])
        rid = trace.request_id[row]
        out.append(
            RequestInput(
                request_id=rid.item() if isinstance(rid, np.generic) else rid,
                prompt_len=int(trace.prompt_len[row]),
                output_len=int(trace.output_len[row]),
                arrival_s=float(trace.arrival_s[row]),
                prompt_ids=None if trace.prompt_ids is None else trace.prompt_ids[row],
                output_ids=None if trace.output_ids is None else trace.output_ids[row],
                needs_history=bool(hist[row]),
                prefix_id=prefix_id,
                prefix_len=prefix_len,
            )
        )
    return out
