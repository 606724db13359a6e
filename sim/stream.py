"""The GPU stream: passes run in launch order, one at a time."""

from __future__ import annotations


def gpu_pass(
    launch_s: float, ready_s: float, free_s: float, gpu_s: float, graphed: bool
) -> tuple[float, float]:
    """(start, end) of a forward pass on the in-order stream. A CUDA graph starts once its
    replay is issued; eager kernels start as the first is issued and the pass cannot end before
    the last is (the stream's busy interval, as the engine's CUDA events measure it)."""
    if graphed:
        start = ready_s if ready_s > free_s else free_s
        return start, start + gpu_s
    start = launch_s if launch_s > free_s else free_s
    end = start + gpu_s
    return start, end if end > ready_s else ready_s
