"""Backup next-token ids (seed 1, vLLM PR 41043).

After a verification step every batch row needs a "next token": the last valid token of its
output row, or, for a row whose sampled tokens are discarded (a prefill chunk that does not reach
the end of the prompt), the row's last known token, the "backup". vLLM fills the backups on the
CPU every speculative step in `prepare_next_token_ids_padded`, then selects on the device:

- before PR 41043: `seq_lens_list = (num_tokens_no_spec[:n] - 1).tolist()`, a list
  comprehension of `get_token_id` calls and a fresh `np.array` of it, stored into the buffer;
- after: one `get_token_id` per row written straight into the preallocated pinned buffer.
Both then copy the first n entries to the device with one non-blocking copy (`CpuGpuBuffer`).
The per-step temporaries of "before" (a list, its ints, an ndarray) are the allocations the PR
removed; the values are identical.

Here a request's `get_token_id(i)` is `token_ids[i]` of its engine.requests.RequestState (the
known tokens as an int32 numpy array); `num_tokens_no_spec[i]` = its known token count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class CpuGpuBuffer:
    """A pinned host int32 buffer, its numpy view and a device twin of the same size."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.cpu = torch.zeros(n, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(n, dtype=torch.int32, device=device)

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        """Enqueue the copy of the first n entries (non-blocking from pinned memory): the host
        must not rewrite them until the copy ran (the engine's ring/step order ensures it)."""
        dst = self.gpu[:n]
        dst.copy_(self.cpu[:n], non_blocking=True)
        return dst


class BackupTokenIds:
    """One buffer per ring slot (batch j uses slot j % depth, see engine.outputs): the host
    rewrites a slot's pinned entries only after batch j - depth was waited on, so after its
    copy ran. (vLLM has one buffer, guarded by its prepare-inputs event.)"""

    def __init__(self, depth: int, max_rows: int, device: torch.device, preallocated: bool) -> None:
        self.preallocated = preallocated
        self.bufs = [CpuGpuBuffer(max_rows, device) for _ in range(depth)]

    def prepare(
        self, ring: int, token_ids: Sequence[np.ndarray], num_tokens_no_spec: np.ndarray, n: int
    ) -> torch.Tensor:
        """Backup ids of rows 0..n-1 on the device (int32 [n]): row i's token at index
        num_tokens_no_spec[i] - 1 of token_ids[i]."""
        buf = self.bufs[ring]
        if self.preallocated:
            return backup_after(buf, token_ids, num_tokens_no_spec, n)
        return backup_before(buf, token_ids, num_tokens_no_spec, n)


def backup_before(
    buf: CpuGpuBuffer, token_ids: Sequence[np.ndarray], num_tokens_no_spec: np.ndarray, n: int
) -> torch.Tensor:
    """vLLM before PR 41043: a Python list and a fresh ndarray each step."""
    seq_lens_list = (num_tokens_no_spec[:n] - 1).tolist()
    buf.np[:n] = np.array(
        [token_ids[i][seq_lens_list[i]] for i in range(n)],
        dtype=np.int32,
    )
    return buf.copy_to_gpu(n)


def backup_after(
    buf: CpuGpuBuffer, token_ids: Sequence[np.ndarray], num_tokens_no_spec: np.ndarray, n: int
) -> torch.Tensor:
    """vLLM after PR 41043: per-element writes into the preallocated pinned buffer."""
    for i in range(n):
        buf.np[i] = token_ids[i][num_tokens_no_spec[i] - 1]
    return buf.copy_to_gpu(n)


def next_token_ids(
    ids: torch.Tensor, num_valid: torch.Tensor, discard: torch.Tensor, backup: torch.Tensor
) -> torch.Tensor:
    """The next token of each row (vLLM's `_eagle_prepare_next_token_padded` in torch):
    ids int32 [B, k + 1] verification output, num_valid int [B] (>= 1 where not discarded),
    discard bool [B], backup int32 [B] -> int32 [B]."""
    last = (num_valid.long() - 1).clamp(min=0)[:, None]
    sampled = ids.gather(1, last)[:, 0]
    return torch.where(discard, backup, sampled)
