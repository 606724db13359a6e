"""Greedy verification of draft tokens, and the accepted-count forms of seed 2 (vLLM PR 38372).

A verification step feeds each decode request its last token and k drafts (k + 1 query tokens)
and samples a target token after each: target [B, k + 1]. Draft j is accepted when it equals
target j and every earlier draft was accepted; the output is target[0 : a + 1] for a accepted
drafts (the last one the "bonus" token), with -1 after it:

    ids [B, k + 1] int32: valid tokens contiguous from column 0, rejected columns = -1.

Drafts of -1 (no proposal, or fewer than k) never match a target (ids are >= 0), so padded
rows simply reject them. The number of valid tokens per row (accepted + 1 = "emitted") is counted
in one of two ways, selected by config `accepted_count_by_sum`:
- before PR 38372: append a -1 sentinel column and take the first -1 by argmax, a
  `torch.cat` + `torch.full` + compare + cast + argmax chain with temporaries each step;
- after: `(ids != -1).sum(dim=1)` written into a preallocated buffer.
Either way the counts then travel to pinned host memory with a non-blocking copy on a side
stream and an event (`AcceptedCounts`), which the CPU waits on only where it must.
"""

from __future__ import annotations

import torch

PLACEHOLDER = -1


def greedy_accept(
    drafts: torch.Tensor, target: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """drafts int32 [B, k] (-1 = none), target int [B, k + 1] -> ids int32 [B, k + 1]."""
    b, k = drafts.shape
    target = target.to(torch.int32)
    match = drafts == target[:, :k]  # [B, k]
    keep = torch.ones((b, k + 1), dtype=torch.bool, device=drafts.device)
    keep[:, 1:] = match.cumprod(dim=1, dtype=torch.int32).bool()
    if out is None:
        return target.masked_fill(~keep, PLACEHOLDER)
    return out.copy_(target).masked_fill_(~keep, PLACEHOLDER)


def count_valid_cat_argmax(ids: torch.Tensor) -> torch.Tensor:
    """Before PR 38372: index of the first -1 after appending a -1 column. int64 [B]."""
    b = ids.shape[0]
    sentinel = torch.full((b, 1), PLACEHOLDER, dtype=ids.dtype, device=ids.device)
    return (torch.cat([ids, sentinel], 1) == PLACEHOLDER).int().argmax(-1)


def count_valid_sum(ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """After PR 38372: valid tokens per row, written into the preallocated `out` [B]."""
    return torch.sum(ids != PLACEHOLDER, dim=1, out=out)


class AcceptedCounts:
    """Per ring slot (one per batch in flight): the device counts, their pinned host copy and the
    event recorded after the copy. count() runs on the compute stream; the copy on a side stream
    that waits for it, so the host can wait for the counts alone, not for later GPU work."""

    def __init__(self, depth: int, max_rows: int, device: torch.device, by_sum: bool) -> None:
        self.by_sum = by_sum
        self.cuda = device.type == "cuda"
        self.device_counts = torch.zeros((depth, max_rows), dtype=torch.int64, device=device)
        pinned = torch.zeros((depth, max_rows), dtype=torch.int64, pin_memory=self.cuda)
        self._host = pinned
        self.host = pinned.numpy()
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self._counted = [torch.cuda.Event() for _ in range(depth)]
            self._copied = [torch.cuda.Event() for _ in range(depth)]

    def count(self, ring: int, ids: torch.Tensor) -> torch.Tensor:
        """Valid tokens per row of `ids` [B, k + 1] -> a device view [B] (int64), then the D2H
        copy of it is started."""
        b = ids.shape[0]
        dst = self.device_counts[ring, :b]
        if self.by_sum:
            count_valid_sum(ids, dst)
        else:
            dst.copy_(count_valid_cat_argmax(ids))
        self._publish(ring, b)
        return dst

    def _publish(self, ring: int, b: int) -> None:
        src, dst = self.device_counts[ring, :b], self._host[ring, :b]
        if not self.cuda:
            dst.copy_(src)
            return
        self._counted[ring].record()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self._counted[ring])
            dst.copy_(src, non_blocking=True)
            self._copied[ring].record()

    def ready(self, ring: int) -> bool:
        return not self.cuda or self._copied[ring].query()

    def wait(self, ring: int) -> None:
        """Block until ring slot `ring`'s counts are on the host (a deliberate sync)."""
        if self.cuda:
            self._copied[ring].synchronize()

    def counts(self, ring: int, b: int):
        """The host counts of ring slot `ring` (valid after `wait`): numpy int64 [b]."""
        return self.host[ring, :b]
