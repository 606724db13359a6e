"""`host_scale`: the simulator's what-if for another host. Every CPU phase's modelled time (launch
included) is multiplied by it; the GPU passes are not; 1.0 is the profile's host to the bit; the
fast path applies it as the step loop does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bubblesim.core.config import ConfigError, load_config
from bubblesim.core.phases import CPU_PHASES
from bubblesim.core.shape import BatchShape
from sim.cost import load_cost_model
from tests.ffcheck import assert_same_records, records_without_and_with_fast_forward
from tests.test_sim import trace_file


def _shape() -> BatchShape:
    return BatchShape(num_reqs=12, num_prefill_reqs=1, prefill_tokens=300, decode_tokens=11,
                      kv_read_tokens=9000, max_kv_tokens=2000)  # fmt: skip


def test_every_cpu_phase_scales_and_the_gpu_pass_does_not() -> None:
    base = load_cost_model(load_config(None, ["model=llama3.2-1b"]))
    slow = load_cost_model(load_config(None, ["model=llama3.2-1b", "host_scale=1.5"]))
    s = _shape()
    for phase in CPU_PHASES:
        assert slow.cpu_phase_ms(phase, s) == pytest.approx(1.5 * base.cpu_phase_ms(phase, s))
    for graphs in (True, False):
        assert slow.launch_ms(s, graphs) == pytest.approx(1.5 * base.launch_ms(s, graphs))
    assert slow.gpu_pass_ms(s) == base.gpu_pass_ms(s)


def test_bad_host_scale_is_refused() -> None:
    for bad in ("0", "-1", "101"):
        with pytest.raises(ConfigError, match="host_scale"):
            load_config(None, ["model=llama3.2-1b", f"host_scale={bad}"])


@pytest.mark.parametrize("depth", [1, 2])
def test_a_slower_host_slows_a_cpu_bound_run_alike_in_both_paths(tmp_path: Path, depth: int):
    n = 24
    trace = trace_file(tmp_path, "t", np.linspace(0, 1.0, n), 200, np.full(n, 100))
    sets = ["model=llama3.2-1b", "gpu=h100", f"batches_in_flight={depth}"]
    base, base_ff = records_without_and_with_fast_forward(sets, trace)
    slow, slow_ff = records_without_and_with_fast_forward([*sets, "host_scale=2.0"], trace)
    assert_same_records(base, base_ff, f"depth {depth}, host_scale 1")
    assert_same_records(slow, slow_ff, f"depth {depth}, host_scale 2")
    span = float(np.nanmax(base.gpu_end))  # the last pass's end
    assert float(np.nanmax(slow.gpu_end)) > span  # a CPU-bound small model: the host paces it
