"""sim.stepcosts: which of a step's costs the fast path may cache per batch size is read off
the cost functions (a probe), not a hand-kept list: a cost reading any field outside the
cache key's (KEY_FIELDS), one added to BatchShape later included, is called at every step.
And the step loop's costs and the fast path's agree (one list, sim.clock.COSTS)."""

from __future__ import annotations

from typing import Any

from bubblesim.core.config import load_config
from bubblesim.core.shape import SHAPE_FIELDS
from sim.clock import COSTS, NUM_SECONDS
from sim.cost import load_cost_model
from sim.stepcosts import KEY_FIELDS, StepCosts, StepShape

GPU = COSTS.index("gpu_s")
PREP = COSTS.index("prepare_inputs_s")


def _costs() -> StepCosts:
    cfg = load_config(None, ["model=llama3-8b", "gpu=h100"])
    return StepCosts(load_cost_model(cfg), cfg.cuda_graphs)


def _decode(b: int, context: int) -> StepShape:
    sh = StepShape()
    sh.set_decode(b)
    sh.kv_read_tokens = sh.attn_pairs = b * context
    sh.max_kv_tokens = context
    sh.context_tokens = b * context
    return sh


def test_a_cost_reading_a_field_outside_the_key_is_never_cached() -> None:
    costs = _costs()

    def reads_new_field(s: Any) -> float:  # reads a field outside KEY_FIELDS
        return 1.0 + 0.001 * s.max_kv_tokens

    def reads_key_only(s: Any) -> float:
        return 2.0 * s.num_reqs

    costs.decode_fns[GPU] = reads_new_field
    costs.decode_fns[PREP] = reads_key_only
    const = costs.const(_decode(8, 100), 8)
    assert const[GPU] is None and [i for i, _, _ in costs.varying(8)].count(GPU) == 1
    assert const[PREP] == 2.0 * 8 / 1e3  # milliseconds in, seconds out, as `all` gives
    assert PREP not in [i for i, _, _ in costs.varying(8)]


def test_key_fields_are_the_fields_a_decode_step_fixes() -> None:
    """Everything else in a decode step moves with its position (the fast path's affine
    sums), so it must not be in KEY_FIELDS."""
    varying = {"kv_read_tokens", "attn_pairs", "max_kv_tokens", "history_tokens", "context_tokens"}
    assert set(SHAPE_FIELDS) - KEY_FIELDS == varying
    assert {"num_tokens", "is_pure_decode"} <= KEY_FIELDS  # BatchShape properties


def test_cached_and_varying_costs_give_what_all_gives() -> None:
    """const + the varying functions at a step == all(shape) of that step, cost by cost."""
    costs = _costs()
    for b, context in ((1, 50), (8, 700), (64, 3000)):
        sh = _decode(b, context)
        c = list(costs.const(sh, b))
        for i, fn, ms in costs.varying(b):
            c[i] = fn(sh) / 1e3 if ms else fn(sh)
        want = costs.all(sh)
        assert c[:NUM_SECONDS] == want[:NUM_SECONDS]
        assert c[NUM_SECONDS:] == want[NUM_SECONDS:]
        assert c[GPU] is not None and c[GPU] > 0
