"""Shared by the GPU tests: run an engine's steps under torch's sync debug mode."""

from __future__ import annotations

import torch


def steps_without_host_sync(eng, warmup: list, reqs: list) -> int:
    """Warm the engine up on `warmup` (Triton compiles, pinned pools, graphs), then step through
    `reqs` with torch.cuda.set_sync_debug_mode("error"): any .item(), .cpu(), pageable copy or
    stream synchronize in the loop raises. Event waits (the output ring, accepted counts with
    seed 5 off) are the deliberate sync points and are not reported by torch. Returns the number
    of steps; the caller calls eng.finish()."""
    eng.run(warmup, arrival="asap")
    for r in reqs:
        eng.add_request(r)
    eng.start()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = 0
        while eng.has_work:
            assert eng.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return steps
