"""Cost functions specialised for a fast-path cache key (`keyed`: sim.cost.roofline.Roofline,
sim.cost.linear.keyed_linear, taken by sim.stepcosts.StepCosts.const) give the unspecialised
function's value to the bit on every shape with the key's fields."""

from __future__ import annotations

import random

from bubblesim.core.config import load_config
from sim.cost import CostModel
from sim.cost.linear import LINEAR_TERMS, compile_linear
from sim.stepcosts import KEY_FIELDS, StepCosts, StepShape

VARYING = ("kv_read_tokens", "attn_pairs", "max_kv_tokens", "history_tokens", "context_tokens")


def _vary(rng: random.Random, sh: StepShape) -> None:
    for name in VARYING:
        setattr(sh, name, rng.randint(0, 10**7))


def _shape(rng: random.Random) -> StepShape:
    sh = StepShape()
    b = rng.randint(1, 512)
    if rng.random() < 0.5:
        sh.set_decode(b)
    else:
        k = rng.randint(1, 5)
        sh.set_verify(b, b * (k + 1), b * k)
    return sh


def test_keyed_linear_same_bits() -> None:
    rng = random.Random(0)
    coefs = (0.0, 1e-4 / 3, -2.5e-3, 7.0)
    checked = 0
    for _ in range(2000):
        terms = rng.sample(LINEAR_TERMS, rng.randint(1, 7))
        model = {t: rng.choice((*coefs, rng.uniform(-1e-3, 1e-3))) for t in terms}
        fn = compile_linear(model)
        if not hasattr(fn, "keyed"):
            continue  # all zero: the constant `zero`
        sh = _shape(rng)
        keyed = fn.keyed(sh, KEY_FIELDS)
        for _ in range(10):
            _vary(rng, sh)
            assert repr(keyed(sh)) == repr(fn(sh)), (model, sh.num_reqs)
            checked += 1
    assert checked > 10_000


def test_keyed_roofline_same_bits() -> None:
    rng = random.Random(1)
    for model in ("llama3-8b", "llama3.2-1b"):
        cost = CostModel(load_config(None, [f"model={model}", "gpu=h100"]))
        roof = cost.roofline
        for _ in range(200):
            sh = _shape(rng)
            keyed = roof.keyed(sh, KEY_FIELDS)
            assert keyed is not roof
            for _ in range(20):
                _vary(rng, sh)
                assert repr(keyed(sh)) == repr(roof(sh))
        assert roof.keyed(_shape(rng), KEY_FIELDS - {"decode_tokens"}) is roof  # not fixed


def test_step_costs_take_keyed_functions() -> None:
    """The default profile's varying decode costs (the roofline, prepare_inputs) come keyed
    and `StepCosts.all` agrees with const + varying at every step."""
    cfg = load_config(None, ["model=llama3-8b", "gpu=h100"])
    costs = StepCosts(CostModel(cfg), True)
    rng = random.Random(2)
    for b in (1, 7, 64, 256):
        sh = StepShape()
        sh.set_decode(b)
        const = costs.const(sh, b)
        varying = costs.varying(b)
        assert varying and all(fn not in costs.decode_fns for _, fn, _ in varying)
        for _ in range(50):
            _vary(rng, sh)
            c = list(const)
            for i, fn, ms in varying:
                c[i] = fn(sh) / 1e3 if ms else fn(sh)
            assert repr(c) == repr(costs.all(sh))
