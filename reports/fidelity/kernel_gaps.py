"""GPU idle gaps in a torch.profiler Chrome trace (`replay.gpu.kernels.profile_kernels`): how much
of a span no kernel, copy or memset was running, by gap length.

    python reports/fidelity/kernel_gaps.py TRACE_JSON [LABEL]

Used on the GPU host by `gpu_runs.sh gaps` (the traces are too large to bring back): at depth 2
the hooks' GPU interval of a step starts when the previous step's work ends, so gaps of tens to
hundreds of microseconds inside a step are counted as GPU time; at depth 1 they fall between
steps. Kernels launched early under programmatic dependent launch overlap; the union of all
intervals is what counts as busy.
"""

from __future__ import annotations

import json
import sys

import numpy as np

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
BANDS_US = ((0, 2), (2, 10), (10, 50), (50, 200), (200, 1000), (1000, float("inf")))


def gaps(path: str) -> tuple[np.ndarray, float, dict[str, int]]:
    """(idle gaps in us, span in us, event counts by category) of a Chrome trace."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    if not dev:
        raise SystemExit(f"{path}: no device events (a CPU-only profile?)")
    start = np.array([e["ts"] for e in dev], float)
    dur = np.array([e["dur"] for e in dev], float)
    order = np.argsort(start)
    start, end = start[order], (start + dur)[order]
    reach = np.maximum.accumulate(end)  # the union of intervals so far ends here
    idle = start[1:] - reach[:-1]
    counts: dict[str, int] = {}
    for e in dev:
        counts[e["cat"]] = counts.get(e["cat"], 0) + 1
    return idle[idle > 0], float(reach[-1] - start[0]), counts


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    idle, span, counts = gaps(argv[0])
    label = argv[1] if len(argv) > 1 else argv[0]
    busy = 100 * (1 - idle.sum() / span)
    print(f"{label}: {counts}, span {span / 1e3:.1f} ms, busy {busy:.1f} %")
    for lo, hi in BANDS_US:
        k = (idle > lo) & (idle <= hi)
        print(f"   gaps {lo:g}-{hi:g} us: {k.sum():6d}, {idle[k].sum() / 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
