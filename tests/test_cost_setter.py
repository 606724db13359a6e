"""sim.stepcosts._setter: a step's costs set by one generated function, with the compiled linear
models' expressions inlined (sim.cost.linear: compile_linear's and keyed_linear's EXPR_ATTR),
give what calling each function gives, to the bit."""

from __future__ import annotations

import random
from typing import Any

from sim.cost.linear import EXPR_ATTR, LINEAR_TERMS, compile_linear
from sim.stepcosts import KEY_FIELDS, StepShape, _setter

VARYING = ("kv_read_tokens", "attn_pairs", "max_kv_tokens", "history_tokens", "context_tokens")
COEFS = (0.0, 1e-4 / 3, -2.5e-3, 7.0, -0.0, 1e300)


def _shape(rng: random.Random) -> StepShape:
    sh = StepShape()
    sh.set_decode(rng.randint(1, 512))
    for name in VARYING:
        setattr(sh, name, rng.randint(0, 10**7))
    return sh


def _model(rng: random.Random) -> dict[str, float]:
    terms = rng.sample(LINEAR_TERMS, rng.randint(1, 7))
    return {t: rng.choice((*COEFS, rng.uniform(-1e-3, 1e-3))) for t in terms}


def test_inlined_linear_models_give_their_calls_bits() -> None:
    rng = random.Random(0)
    inlined = 0
    for _ in range(1500):
        fn = compile_linear(_model(rng))
        sh = _shape(rng)
        fns: list[Any] = [fn]
        if hasattr(fn, "keyed"):
            fns.append(fn.keyed(sh, KEY_FIELDS))  # its expression holds the folded numbers
        for f in fns:
            inlined += hasattr(f, EXPR_ATTR)
            rounded = lambda s, f=f: round(f(s))  # noqa: E731
            if hasattr(f, EXPR_ATTR):  # as StepCosts' alloc wrapper marks it
                setattr(rounded, EXPR_ATTR, f"round({getattr(f, EXPR_ATTR)})")  # noqa: B010
            out: list[Any] = [None] * 3
            _setter([(0, f, True), (1, f, False), (2, rounded, False)])(sh, out)
            want = [f(sh) / 1e3, f(sh), round(f(sh))]
            assert repr(out) == repr(want), getattr(f, EXPR_ATTR, f)
    assert inlined > 1500


def test_other_functions_are_called() -> None:
    calls: list[int] = []

    def gpu_ms(s: Any) -> float:
        calls.append(s.num_reqs)
        return 2.5 * s.num_reqs

    sh = StepShape()
    sh.set_decode(4)
    out: list[Any] = [0.0, 0.0]
    _setter([(1, gpu_ms, True)])(sh, out)
    assert out == [0.0, 10.0 / 1e3] and calls == [4]
    _setter([])(sh, out)  # nothing to set
    assert out == [0.0, 10.0 / 1e3]
