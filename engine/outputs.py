"""The async output path: sampled tokens travel device -> pinned host on a side stream, and the
CPU reads them only after waiting on that batch's event (the one deliberate sync of the loop).
Also the placeholder scan of seed 3 (vLLM PR 42938).

Ring discipline (depth D = batches_in_flight): batch j uses ring slot j % D for its device token
row, pinned host row and events. The loop launches batch j only after batch j - D was waited on
and applied, so slot j % D is free when batch j's sampler writes it: no slot is overwritten
while its copy or its host read is pending.

On CPU there are no streams or events: the "copy" is an immediate memcpy and waits are no-ops,
so the loop runs the same code on both devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class OutputRing:
    def __init__(self, depth: int, max_rows: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # device_tokens[k, :n]: the n tokens batch k sampled (one per generating entry)
        self.device_tokens = torch.zeros((depth, max_rows), dtype=torch.int32, device=device)
        host = torch.zeros((depth, max_rows), dtype=torch.int32, pin_memory=self.cuda)
        self._host = host
        self.host = host.numpy()  # [depth, max_rows] view of the pinned buffer
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self._sampled = [torch.cuda.Event() for _ in range(depth)]
            self._copied = [torch.cuda.Event() for _ in range(depth)]

    def publish(self, k: int, n: int) -> None:
        """Start the D2H copy of `device_tokens[k, :n]` once the compute stream has written it."""
        src, dst = self.device_tokens[k, :n], self._host[k, :n]
        if not self.cuda:
            dst.copy_(src)
            return
        self._sampled[k].record()  # on the compute stream, after the sampler
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self._sampled[k])
            dst.copy_(src, non_blocking=True)
            self._copied[k].record()

    def ready(self, k: int) -> bool:
        """Has batch k's copy landed? Never blocks."""
        return not self.cuda or self._copied[k].query()

    def wait(self, k: int) -> None:
        """Block until batch k's tokens are on the host: the loop's deliberate sync point.
        (torch's sync debug mode does not treat event waits as syncs; nothing to silence.)"""
        if self.cuda:
            self._copied[k].synchronize()

    def tokens(self, k: int, n: int) -> np.ndarray:
        return self.host[k, :n]


# ---- placeholders (seed 3) ----------------------------------------------------------------------


def first_placeholder(output: list[int], reverse: bool) -> int:
    """Index of the first -1 placeholder; placeholders always form the list's tail.

    reverse=False is vLLM's code before PR 42938: `list.index(-1)`, a scan from the front that is
    O(output length). reverse=True is the code after: walk back over the trailing run of -1,
    O(number of placeholders). Both return len(output) when there is no placeholder."""
    if not reverse:
        try:
            return output.index(-1)
        except ValueError:
            return len(output)
    i = len(output)
    while i > 0 and output[i - 1] == -1:
        i -= 1
    return i


def update_async_output_token_ids(output: list[int], sampled: Sequence[int], reverse: bool) -> int:
    """Fill the first placeholders of `output` with the tokens of the oldest in-flight batch that
    produced them (vLLM `InputBatch.update_async_output_token_ids`). Returns tokens written."""
    first = first_placeholder(output, reverse)
    n = min(len(sampled), len(output) - first)
    if n > 0:
        output[first : first + n] = sampled[:n]
    return n
