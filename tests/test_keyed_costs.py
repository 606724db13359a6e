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


def test_keyed_tables_splines_and_models_same_bits() -> None:
    """Tables and splines with an axis the key fixes (sim.cost.table: the lookup along it done
    once, or one Const), inside a compiled max model with derived terms (sim.cost.linear:
    a Const inlined as a literal): the same float as the full function on every shape."""
    from sim.cost.linear import compile_model  # why lazy: only these two tests read them
    from sim.cost.table import Const

    rng = random.Random(2)
    xs = [1.0, 4.0, 16.0, 64.0, 256.0]
    ys = [10.0, 300.0, 2000.0, 9000.0]
    table = {
        "x": "num_tokens", "y": "kv_per_token", "xs": xs, "ys": ys,
        "ms": [[rng.uniform(0.1, 9.0) for _ in ys] for _ in xs],
    }  # fmt: skip
    spline = {"x": "num_reqs", "knots": xs, "ms": [rng.uniform(0.1, 9.0) for _ in xs]}
    both = {**table, "x": "num_reqs", "y": "num_tokens"}  # every axis fixed: one number
    derived = {"program_keys": lambda s: s.max_kv_tokens // 16}
    model = {"max": [
        {"intercept": 0.25, "table": table, "kv_read_tokens": 1e-6},
        {"spline": spline, "program_keys": 2e-3},
        {"table": both, "num_reqs": 1e-3},
    ]}  # fmt: skip
    fn = compile_model(model, derived)
    checked = 0
    for _ in range(300):
        sh = _shape(rng)
        keyed = fn.keyed(sh, KEY_FIELDS)  # type: ignore[attr-defined]
        for _ in range(20):
            _vary(rng, sh)
            assert repr(keyed(sh)) == repr(fn(sh)), sh.num_reqs
            checked += 1
    assert checked == 6000
    from sim.cost.table import compile_spline, compile_table  # why lazy: as above

    sh = _shape(rng)
    assert isinstance(compile_spline(spline).keyed(sh, KEY_FIELDS), Const)  # type: ignore[attr-defined]
    assert isinstance(compile_table(both).keyed(sh, KEY_FIELDS), Const)  # type: ignore[attr-defined]
    t = compile_table(table)
    assert not isinstance(t.keyed(sh, KEY_FIELDS), Const)  # type: ignore[attr-defined]


def test_committed_profiles_decode_pass_keyed_same_bits() -> None:
    """The committed profiles' decode pass (a table and a spline with the tail and program
    keys, the penalties' history term, the verify model, random sampling's term) keyed for a
    batch size: the same float as the step loop's on every shape."""
    from sim.cost.profile import load_profile  # why lazy: only this test reads a profile

    gen = "reports/fidelity/gen"
    cases = [
        ["model=llama3-8b", f"profile={gen}/profile-h100-llama3-8b.json"],
        ["model=llama3.2-1b", "gpu=h200", f"profile={gen}/profile-h200-llama3.2-1b.json"],
        ["model=llama3.2-1b", f"profile={gen}/profile-h100-llama3.2-1b.json",
         "spec.method=ngram-gpu", "spec.k=3"],
        ["model=llama3-8b", "gpu=h200", f"profile={gen}/profile-h200-llama3-8b.json",
         "sampling.temperature=0.8", "sampling.top_p=0.9"],
    ]  # fmt: skip
    rng = random.Random(3)
    for sets in cases:
        cfg = load_config(None, sets)
        fn = CostModel(cfg, load_profile(cfg.profile)).gpu_decode_ms_fn()
        assert hasattr(fn, "keyed"), sets  # else the fast path calls the whole function
        k = cfg.spec.k if cfg.spec.enabled else 0
        for _ in range(60):
            sh = StepShape()
            b = rng.randint(1, 256)
            if k:
                sh.set_verify(b, b * (k + 1), b * k)
            else:
                sh.set_decode(b)
            keyed = fn.keyed(sh, KEY_FIELDS)  # type: ignore[attr-defined]
            for _ in range(20):
                mx = rng.randint(1, 130_000)
                sh.max_kv_tokens = mx
                sh.kv_read_tokens = sh.attn_pairs = sh.context_tokens = rng.randint(b, b * mx)
                sh.history_tokens = rng.choice((0, 0, rng.randint(1, 10**6)))
                assert repr(keyed(sh)) == repr(fn(sh)), (sets, b)
