"""Linear cost models over `BatchShape` fields: the one form every fitted cost takes.

A linear model is a dict `{term: coefficient}` in the profile file, where a term is
`"intercept"`, a `BatchShape` field (`bubblesim.core.shape.SHAPE_FIELDS`) or `"num_tokens"` (the
derived
prefill + decode token count). `replay calibrate` fits one by plain least squares over
`design_row(shape, terms)`; the simulator evaluates it through `compile_linear`, which turns the
dict into one Python expression so a call is a handful of float multiply-adds (it runs several
times per simulated step, for millions of steps).

A GPU pass model may also be `{"max": [LINEAR, LINEAR, ...]}`: the larger of its branches
(`compile_model`; pure decode: the KV stream vs the longest attention program), and its linear
models may use derived terms the caller defines for one model and GPU (`derived`:
`program_keys`, sim.cost.splits; a mixed model's `mixed_keys` and `grid_blocks`,
sim.cost.mixedsplits), which compile to a call of the caller's function. A GPU pass
model (or branch) may also hold a piecewise-linear term, `"table"` or `"spline"`
(sim.cost.table), added to its linear terms and compiled to a call the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from bubblesim.core.shape import SHAPE_FIELDS, BatchShape

from .mixedsplits import MIXED_DERIVED
from .table import NONLINEAR_KEYS, TABLE_KEY, Const, compile_spline, compile_table

INTERCEPT = "intercept"
LINEAR_TERMS: tuple[str, ...] = (INTERCEPT, *SHAPE_FIELDS, "num_tokens")
MAX_KEY = "max"
# derived terms that need the model and GPU (sim.cost.splits): pure-decode GPU models only
PROGRAM_KEYS = "program_keys"
TAIL_KEYS = "tail_keys"  # the longest program's keys beyond the mean row's (sim.cost.splits)
DECODE_TERMS: tuple[str, ...] = (*LINEAR_TERMS, PROGRAM_KEYS, TAIL_KEYS)
# derived terms of mixed-step models (the paged attention kernel's, sim.cost.mixedsplits)
MIXED_TERMS: tuple[str, ...] = (*LINEAR_TERMS, *MIXED_DERIVED)

LinearFn = Callable[[BatchShape], float]
EXPR_ATTR = "expr"  # compile_linear's functions without derived terms: their expression
Derived = Mapping[str, LinearFn]


def zero(shape: BatchShape) -> float:
    return 0.0


def add_linear(*models: Mapping[str, float]) -> dict[str, float]:
    """Sum of linear models, term by term (a phase's base model plus its active seed terms)."""
    out: dict[str, float] = {}
    for m in models:
        for term, coef in m.items():
            out[term] = out.get(term, 0.0) + coef
    return out


def _source(model: Mapping[str, float], derived: Derived) -> str:
    """`model` as a Python expression in `s` ("0.0" if empty); derived term i calls `_d{i}`.
    Built only from names in LINEAR_TERMS / `derived` and float reprs, never from free text."""
    known = (*LINEAR_TERMS, *derived)
    unknown = sorted(set(model) - set(known))
    if unknown:
        raise ValueError(f"unknown linear term {unknown[0]!r}, expected one of {known}")
    parts: list[str] = []
    for term in known:  # fixed order: same model, same float result
        coef = float(model.get(term, 0.0))
        if coef == 0.0:
            continue
        if term == INTERCEPT:
            parts.append(repr(coef))
        elif term in derived:
            parts.append(f"{coef!r} * _d{list(derived).index(term)}(s)")
        else:
            parts.append(f"{coef!r} * s.{term}")
    return " + ".join(parts) or "0.0"


def _compile(expr: str, derived: Derived) -> LinearFn:
    env: dict[str, Any] = {"__builtins__": {}, "max": max}
    env.update({f"_d{i}": fn for i, fn in enumerate(derived.values())})
    fn: LinearFn = eval(f"lambda s: {expr}", env)  # noqa: S307
    return fn


def compile_linear(model: Mapping[str, float], derived: Derived | None = None) -> LinearFn:
    """A function `shape -> float` evaluating `model`; terms with a zero coefficient are dropped.
    `derived`: extra term name -> function of the shape (e.g. `program_keys`). Without derived
    terms it has `keyed(shape, fixed)` (`keyed_linear`), as sim.stepcosts.StepCosts takes it."""
    expr = _source(model, derived or {})
    if expr == "0.0":
        return zero
    fn = _compile(expr, derived or {})
    if not derived:
        frozen = dict(model)
        setattr(fn, "keyed", lambda s, fixed: keyed_linear(frozen, s, fixed))  # noqa: B010
        # its body: an expression in `s` and float literals only (sim.stepcosts inlines it)
        setattr(fn, EXPR_ATTR, expr)  # noqa: B010
    return fn


def keyed_linear(model: Mapping[str, float], s: Any, fixed: Collection[str]) -> LinearFn:
    """`compile_linear(model)` for the shapes whose `fixed` fields are `s`'s: the terms before
    the first other field summed into one number, later fixed terms as their products, so a
    call does the same float operations in the same order (the same value to the bit) with
    fewer of them."""
    env: dict[str, Any] = {"__builtins__": {}}
    parts: list[str] = []
    for term in LINEAR_TERMS:  # _source's order
        coef = float(model.get(term, 0.0))
        if coef == 0.0:
            continue
        if term == INTERCEPT or term in fixed:
            x = coef if term == INTERCEPT else coef * getattr(s, term)
            if parts:
                parts.append(f"_c{len(env)}")
                env[parts[-1]] = x
            else:  # the leading sum, as the full expression adds it up
                env["_v"] = x if "_v" not in env else env["_v"] + x
        else:
            parts.append(f"{coef!r} * s.{term}")
    if "_v" in env:
        parts.insert(0, "_v")
    fn: LinearFn = eval(f"lambda s: {' + '.join(parts) or '0.0'}", env)  # noqa: S307
    folded = [env[p] for p in parts if p in env]
    if all(math.isfinite(x) for x in folded):  # its expression: the numbers as literals (repr
        # gives a float back to the bit)
        literal = " + ".join(repr(env[p]) if p in env else p for p in parts) or "0.0"
        setattr(fn, EXPR_ATTR, literal)  # noqa: B010
    return fn


def is_max_model(model: Mapping[str, Any]) -> bool:
    return MAX_KEY in model


def branches(model: Mapping[str, Any]) -> list[Mapping[str, float]]:
    """The linear models of a GPU pass model: the branches of a max form, else itself."""
    return list(model[MAX_KEY]) if is_max_model(model) else [model]


def split_nonlinear(model: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """A GPU pass model (or branch) as (its linear terms, its table/spline terms)."""
    lin = {k: v for k, v in model.items() if k not in NONLINEAR_KEYS}
    return lin, {k: model[k] for k in NONLINEAR_KEYS if k in model}


def _add_branch(model: Mapping[str, Any], extra: Mapping[str, float]) -> dict[str, Any]:
    lin, nonlin = split_nonlinear(model)
    return {**add_linear(lin, extra), **nonlin}


def add_to_model(model: Mapping[str, Any], extra: Mapping[str, float]) -> dict[str, Any]:
    """`model + extra` for a linear model or a max form (added to every branch: max(a, b) + e
    = max(a + e, b + e)); table and spline terms are kept as they are."""
    if is_max_model(model):
        return {MAX_KEY: [_add_branch(b, extra) for b in model[MAX_KEY]]}
    return _add_branch(model, extra)


def _branch_source(model: Mapping[str, Any], derived: dict[str, LinearFn]) -> str:
    """`_source` of a branch; its table/spline term joins `derived` (coefficient 1) under a name
    no linear term has."""
    lin, nonlin = split_nonlinear(model)
    for key, term in nonlin.items():
        name = f"_{key}{len(derived)}"
        derived[name] = compile_table(term) if key == TABLE_KEY else compile_spline(term)
        lin[name] = 1.0
    return _source(lin, derived)


def compile_model(model: Mapping[str, Any], derived: Derived | None = None) -> LinearFn:
    """`compile_linear`, or for `{"max": [m1, m2, ...]}` one function `max(m1(s), m2(s), ...)`;
    a table or spline term compiles to one call inside the expression. With derived or
    nonlinear terms it has `keyed(shape, fixed)` (`_keyed_model`)."""
    terms = dict(derived or {})
    if not is_max_model(model):
        expr = _branch_source(model, terms)
        if expr == "0.0":
            return zero
    else:
        expr = f"max({', '.join(_branch_source(b, terms) for b in model[MAX_KEY])})"
    fn = _compile(expr, terms)
    if terms:
        setattr(fn, "keyed", lambda s, fixed: _keyed_model(expr, terms, s, fixed))  # noqa: B010
    return fn


def _keyed_model(expr: str, terms: Derived, s: Any, fixed: Collection[str]) -> LinearFn:
    """`compile_model`'s function for the shapes whose `fixed` fields are `s`'s: each derived
    term with a `keyed` form takes it (sim.cost.table: a lookup along a fixed axis done once),
    and one that is a single number there (table.Const) is inlined as a literal (repr gives the
    float back to the bit); the expression is otherwise the same, so is every value."""
    env: dict[str, LinearFn] = {}
    for i, (name, fn) in enumerate(terms.items()):
        keyed = getattr(fn, "keyed", None)
        got = fn if keyed is None else keyed(s, fixed)
        if isinstance(got, Const) and math.isfinite(got.value):
            expr = expr.replace(f"_d{i}(s)", f"({got.value!r})")
        env[name] = got
    return _compile(expr, env)


def has_nonlinear(model: Mapping[str, Any]) -> bool:
    """Whether a GPU pass model (or a branch of its max form) holds a table or spline term."""
    return any(k in b for b in branches(model) for k in NONLINEAR_KEYS)


def design_row(shape: BatchShape, terms: Iterable[str]) -> list[float]:
    """The regressors of `shape` for `terms` (LINEAR_TERMS names), for least-squares fits."""
    return [1.0 if t == INTERCEPT else float(getattr(shape, t)) for t in terms]


def evaluate(model: Mapping[str, float], shape: BatchShape) -> float:
    """Slow reference evaluation (tests, one-off reports); the hot path uses compile_linear."""
    terms = list(model)
    return sum(c * x for c, x in zip(model.values(), design_row(shape, terms), strict=True))
