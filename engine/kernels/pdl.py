"""Programmatic dependent launch (PDL, Hopper and later) for the decode-path kernels.

A kernel launched with PDL may start while the kernel before it on the stream is still running:
its programs become resident as SMs free up, do the work that depends on nothing the previous
kernel writes (issue weight prefetches, load step metadata), then `gdc_wait()` until the previous
kernel has completed and its writes are visible, then `gdc_launch_dependents()` so that the next
kernel may start the same way. At batch 1 a decode step is ~230 short kernels, each paying a
launch, a ramp (first loads in flight) and a tail (stragglers); PDL overlaps those with the
neighbours' work.

Rules every PDL kernel here keeps (they make the overlap safe):
- before `gdc_wait` it writes nothing, and reads only data that no kernel of the last two
  launches writes: weights, step inputs (written by copies and kernels at the step's start,
  before the graph's first PDL kernel), KV-cache entries of earlier steps;
- it calls `gdc_launch_dependents` only after its `gdc_wait`. Hence when kernel N starts, kernel
  N - 2 has completed (N - 1 triggered only after waiting for it), so the reads above are safe.
Kernels not launched with PDL (torch ops, cuBLAS) serialize as usual; `gdc_wait` is a no-op
there. On CPU (TRITON_INTERPRET=1) and before Hopper, PDL is off.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Launch the kernels working on `t` with PDL? (ENGINE_PDL=0 turns it off, for A/B runs.)"""
    if t.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("ENGINE_PDL", "1") == "0":
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_options(on: bool) -> dict:
    """Extra launch keywords: `launch_pdl` only when on (the interpreter knows no such option)."""
    return {"launch_pdl": True} if on else {}
