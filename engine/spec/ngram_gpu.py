"""Prompt-lookup (n-gram) drafting on the device, for a batch of requests at once, with no host
sync (seed 4, vLLM PR 29184). Proposes exactly what `bubblesim.core.ngram.propose` proposes for the
same
tokens: drafts [B, k] int32, the first len(propose(...)) entries equal to it, the rest -1.

Token buffer: `token_ids` int32 [max_num_seqs + 1, max_model_len] on the device, row s holding
slot s's known tokens (prompt + accepted outputs; the last row is a trash row that absorbs the
writes of rejected positions), and `num_tokens` int32 [max_num_seqs + 1] the valid length of each
row. Memory is 4 * (max_num_seqs + 1) * max_model_len bytes: 256 x 8 K -> 8 MiB, 256 x 128 K ->
128 MiB, 1024 x 1 M -> 4 GiB (the "massive buffer" of the PR review). A proposal reads a window
of W columns, W a host-known upper bound of the batch's lengths, and does max_n int32 compares
plus one max-reduction per element: O(B * W * max_n) GPU work, growing with context length.

Match rule, restated for tensors. bubblesim.core.ngram looks, for n = max_n .. min_n, for the most
recent
start s <= L - n - 1 with tokens[s : s + n] == tokens[L - n : L]. Index a window by its END e =
s + n - 1 instead: with r[e] = the number of i in 0, 1, .. (stopping at the first mismatch,
capped at max_n) with tokens[e - i] == tokens[L - 1 - i], a length-n match ends at e iff r[e] >=
n, and s <= L - n - 1 iff e <= L - 2. The longest n with a match is max r[e] over e <= L - 2 (if
>= min_n), and its most recent match is the largest such e: one max of r[e] * W + e. Drafts are
tokens[e + 1 : e + 1 + k], cut at L.
"""

from __future__ import annotations

import numpy as np
import torch

_SENTINEL = -2  # left padding for e - i < 0: never equal to a token id (>= 0)


def propose_ngram(
    rows: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    min_n: int,
    max_n: int,
) -> torch.Tensor:
    """rows int32 [B, W] (row b's tokens in columns < lengths[b]; later columns are ignored),
    lengths int [B] (each <= W) -> drafts int32 [B, k], -1 where there is no draft."""
    b, w = rows.shape
    dev = rows.device
    assert (max_n + 1) * (w + 1) < 2**31, "window too wide for int32 match keys"
    lengths = lengths.to(torch.int32)
    padded = torch.nn.functional.pad(rows, (max_n, 0), value=_SENTINEL)  # [B, max_n + W]
    last = (lengths - 1)[:, None]  # [B, 1]
    run = torch.zeros((b, w), dtype=torch.int32, device=dev)  # r[e], capped at max_n
    alive = torch.ones((b, w), dtype=torch.bool, device=dev)
    for i in range(max_n):
        suffix_tok = rows.gather(1, (last - i).clamp(min=0).long())  # tokens[L - 1 - i]
        alive &= padded[:, max_n - i : max_n - i + w] == suffix_tok  # tokens[e - i]
        run += alive
    ends = torch.arange(w, dtype=torch.int32, device=dev)[None, :]
    ok = (ends <= last - 1) & (run >= min_n)
    key = torch.where(ok, run * w + ends, -1).amax(dim=1)  # [B]
    end = key.remainder(w)  # meaningful where key >= 0
    pos = end[:, None] + 1 + torch.arange(k, dtype=torch.int32, device=dev)[None, :]  # [B, k]
    valid = (key >= 0)[:, None] & (pos <= last)
    toks = rows.gather(1, pos.clamp(max=w - 1).long())
    return torch.where(valid, toks, -1)


class NgramProposerGPU:
    """The per-slot token buffer and the proposer over it. All methods only enqueue device
    work: nothing reads a device value on the host."""

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        k: int,
        min_n: int,
        max_n: int,
        device: torch.device,
    ) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.max_model_len = max_model_len
        self.device = device
        self.trash = max_num_seqs  # the row that absorbs writes of invalid positions
        shape = (max_num_seqs + 1, max_model_len)
        self.token_ids = torch.zeros(shape, dtype=torch.int32, device=device)
        self.num_tokens = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self._cols = torch.arange(max_model_len, dtype=torch.int32, device=device)
        self.pinned = device.type == "cuda"

    @property
    def buffer_bytes(self) -> int:
        return self.token_ids.numel() * self.token_ids.element_size()

    def reset_slot(self, slot: int, token_ids: np.ndarray) -> None:
        """Slot `slot` now holds a request whose known tokens are `token_ids` (its prompt, plus
        confirmed outputs after a preemption). Stream ordered after earlier users of the slot."""
        n = len(token_ids)
        src = torch.from_numpy(np.ascontiguousarray(token_ids, dtype=np.int32))
        if self.pinned:
            src = src.pin_memory()
        self.token_ids[slot, :n].copy_(src, non_blocking=True)
        self.num_tokens[slot].fill_(n)  # device fill, no host scalar copy

    def append(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append each row's valid tokens: slots int [B] (distinct), tokens int32 [B, C] with
        the valid ones contiguous from column 0 and -1 after (verification output)."""
        c = tokens.shape[1]
        slots = slots.long()
        tokens = tokens.to(torch.int32)
        valid = tokens >= 0
        start = self.num_tokens[slots].long()  # [B]
        pos = start[:, None] + torch.arange(c, device=self.device)[None, :]
        ok = valid & (pos < self.max_model_len)
        row = torch.where(ok, slots[:, None], self.trash)
        self.token_ids.index_put_((row, pos.clamp(max=self.max_model_len - 1)), tokens)
        self.num_tokens[slots] = (start + valid.sum(dim=1)).to(torch.int32)

    def propose(self, slots: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        """Drafts int32 [B, k] for slots int [B]. `max_len` (host int) >= every row's length
        bounds the scanned window; default max_model_len."""
        w = min(max_len or self.max_model_len, self.max_model_len)
        slots = slots.long()
        rows = self.token_ids[slots, :w]
        lengths = self.num_tokens[slots]
        return propose_ngram(rows, lengths, self.k, self.min_n, self.max_n)
