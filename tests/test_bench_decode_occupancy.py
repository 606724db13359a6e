"""bench/decode_occupancy.py: blocks an SM holds from a compiled kernel's registers, shared
memory and warps (the arithmetic; the measurement itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from decode_occupancy import blocks_per_sm  # noqa: E402

H100 = SimpleNamespace(
    regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
    shared_memory_per_multiprocessor=233472,
)  # fmt: skip


def test_the_measured_kernels_blocks_per_sm() -> None:
    """The decode kernel's compiled resources on an H100 (reports/fidelity/gen/j/occupancy-h100.txt)
    give its slots: registers allocated a warp at a time in units of 256."""
    assert blocks_per_sm(122, 39424, 4, H100)["blocks_per_sm"] == 4  # llama3-8b, graphs
    assert blocks_per_sm(152, 39424, 4, H100)["blocks_per_sm"] == 3  # llama3-8b, plain
    assert blocks_per_sm(72, 20992, 4, H100)["blocks_per_sm"] == 7  # llama3.2-1b
    # 120 registers a thread round to 3840 a warp (15 units): 4 blocks; 129 to 4352: 3
    assert blocks_per_sm(120, 0, 4, H100)["registers"] == 4
    assert blocks_per_sm(129, 0, 4, H100)["registers"] == 3
    # the thread and shared-memory limits bind when registers do not
    got = blocks_per_sm(16, 100_000, 8, H100)
    assert got["threads"] == 8 and got["shared"] == 2 and got["blocks_per_sm"] == 2
