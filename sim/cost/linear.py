"""Linear cost models over `BatchShape` fields: the one form every fitted cost takes.

A linear model is a dict `{term: coefficient}` in the profile file, where a term is
`"intercept"`, a `BatchShape` field (`core.shape.SHAPE_FIELDS`) or `"num_tokens"` (the derived
prefill + decode token count). `replay calibrate` fits one by plain least squares over
`design_row(shape, terms)`; the simulator evaluates it through `compile_linear`, which turns the
dict into one Python expression so a call is a handful of float multiply-adds (it runs several
times per simulated step, for millions of steps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from core.shape import SHAPE_FIELDS, BatchShape

INTERCEPT = "intercept"
LINEAR_TERMS: tuple[str, ...] = (INTERCEPT, *SHAPE_FIELDS, "num_tokens")

LinearFn = Callable[[BatchShape], float]


def zero(shape: BatchShape) -> float:
    return 0.0


def add_linear(*models: Mapping[str, float]) -> dict[str, float]:
    """Sum of linear models, term by term (a phase's base model plus its active seed terms)."""
    out: dict[str, float] = {}
    for m in models:
        for term, coef in m.items():
            out[term] = out.get(term, 0.0) + coef
    return out


def compile_linear(model: Mapping[str, float]) -> LinearFn:
    """A function `shape -> float` evaluating `model`; terms with a zero coefficient are dropped.

    The source is built only from names in LINEAR_TERMS and float reprs, never from free text.
    """
    parts: list[str] = []
    for term in LINEAR_TERMS:  # fixed order: same model, same float result
        coef = float(model.get(term, 0.0))
        if coef == 0.0:
            continue
        parts.append(repr(coef) if term == INTERCEPT else f"{coef!r} * s.{term}")
    unknown = sorted(set(model) - set(LINEAR_TERMS))
    if unknown:
        raise ValueError(f"unknown linear term {unknown[0]!r}, expected one of {LINEAR_TERMS}")
    if not parts:
        return zero
    fn: LinearFn = eval(f"lambda s: {' + '.join(parts)}", {"__builtins__": {}})  # noqa: S307
    return fn


def design_row(shape: BatchShape, terms: Iterable[str]) -> list[float]:
    """The regressors of `shape` for `terms` (LINEAR_TERMS names), for least-squares fits."""
    return [1.0 if t == INTERCEPT else float(getattr(shape, t)) for t in terms]


def evaluate(model: Mapping[str, float], shape: BatchShape) -> float:
    """Slow reference evaluation (tests, one-off reports); the hot path uses compile_linear."""
    terms = list(model)
    return sum(c * x for c, x in zip(model.values(), design_row(shape, terms), strict=True))
