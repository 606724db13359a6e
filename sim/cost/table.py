"""Piecewise-linear GPU pass terms: a 2-D table (bilinear) and a 1-D spline (linear).

A fitted GPU pass model (`gpu_pass.decode` / `mixed`, or a branch of a max form) is a linear
model that may also hold one of these, added to its linear terms (docs/cost-model.md):

  "table":  {"x": X, "y": Y, "xs": [...], "ys": [...], "ms": [[...] per x]}   bilinear in (x, y)
  "spline": {"x": FIELD, "knots": [...], "ms": [...]}                         linear between knots

Axes: X in TABLE_X (query rows: num_tokens, which counts spec-decode verify rows), Y in TABLE_Y
(`kv_per_token` = kv_read_tokens / num_tokens, `kv_per_req` = kv_read_tokens / num_reqs, or the
sum kv_read_tokens); a spline's x is any shape field or num_tokens. Grid values increase
strictly; ms are >= 0.

Outside the grid (one rule for both, `_segments` and its scalar form `_SEGMENT`): below
the first value the edge value holds (clamp: a smaller batch or context never costs less than
the smallest measured one), above the last the edge segment continues linearly (KV streaming
and compute-bound GEMMs grow linearly with their size). With both axes past their last value
the bilinear form continues too (its x*y term is the per-row KV read of a larger batch).

`compile_table` / `compile_spline` give one plain function of a shape (generated from a fixed
template and the validated axis names: a few float operations and two `bisect` calls, ~1 us);
`table_values` / `spline_values` evaluate the same rule on numpy columns (calibration,
reports); `table_weights` / `spline_weights` are the rule's weights, which a least-squares fit
uses as its design matrix, so fit and evaluation cannot disagree.
A function reads every shape field it depends on each call, unconditionally (the fast-forward's
probe, sim/stepcosts.py `Probe`, sees which fields a cost reads).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from bubblesim.core.shape import SHAPE_FIELDS, BatchShape

TABLE_KEY = "table"
SPLINE_KEY = "spline"
NONLINEAR_KEYS = (TABLE_KEY, SPLINE_KEY)
TABLE_X = ("num_tokens", "num_reqs")
TABLE_Y = ("kv_per_token", "kv_per_req", "kv_read_tokens")
SPLINE_X: tuple[str, ...] = (*SHAPE_FIELDS, "num_tokens")
TABLE_FIELDS = ("x", "y", "xs", "ys", "ms")
SPLINE_FIELDS = ("x", "knots", "ms")

ShapeFn = Callable[[BatchShape], float]
Cols = Mapping[str, np.ndarray]


class TableError(ValueError):
    """A bad table or spline: `key` is the offending key below the term (e.g. 'ms[2][1]')."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(why)
        self.key = key
        self.why = why


# ---- validation ----------------------------------------------------------------------------------
def _finite(key: str, v: Any, nonneg: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v):
        raise TableError(key, f"expected a finite number, got {v!r}")
    if nonneg and v < 0:
        raise TableError(key, f"must be >= 0, got {v!r}")
    return float(v)


def _axis(key: str, v: Any) -> list[float]:
    if not isinstance(v, list) or len(v) < 2:
        raise TableError(key, f"expected a list of 2 or more increasing numbers, got {v!r}")
    out = [_finite(f"{key}[{i}]", x) for i, x in enumerate(v)]
    for i in range(1, len(out)):
        if out[i] <= out[i - 1]:
            raise TableError(f"{key}[{i}]", f"values must increase strictly, got {v!r}")
    return out


def _keys(t: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(t, dict):
        raise TableError("", f"expected an object with keys {list(allowed)}, got {t!r}")
    for k in t:
        if k not in allowed:
            raise TableError(k, f"unknown key, expected one of {list(allowed)}")
    for k in allowed:
        if k not in t:
            raise TableError(k, "missing")
    return t


def check_table(t: Any) -> None:
    """Raise TableError naming the bad key of a `table` term."""
    t = _keys(t, TABLE_FIELDS)
    if t["x"] not in TABLE_X:
        raise TableError("x", f"expected one of {list(TABLE_X)}, got {t['x']!r}")
    if t["y"] not in TABLE_Y:
        raise TableError("y", f"expected one of {list(TABLE_Y)}, got {t['y']!r}")
    xs, ys = _axis("xs", t["xs"]), _axis("ys", t["ys"])
    ms = t["ms"]
    if not isinstance(ms, list) or len(ms) != len(xs):
        raise TableError("ms", f"expected {len(xs)} rows (one per xs value), got {ms!r}")
    for i, row in enumerate(ms):
        if not isinstance(row, list) or len(row) != len(ys):
            raise TableError(f"ms[{i}]", f"expected {len(ys)} numbers (one per ys value)")
        for j, v in enumerate(row):
            _finite(f"ms[{i}][{j}]", v)


def check_spline(t: Any) -> None:
    """Raise TableError naming the bad key of a `spline` term."""
    t = _keys(t, SPLINE_FIELDS)
    if t["x"] not in SPLINE_X:
        raise TableError("x", f"expected a shape field or num_tokens, got {t['x']!r}")
    knots = _axis("knots", t["knots"])
    ms = t["ms"]
    if not isinstance(ms, list) or len(ms) != len(knots):
        raise TableError("ms", f"expected {len(knots)} numbers (one per knot), got {ms!r}")
    for i, v in enumerate(ms):
        _finite(f"ms[{i}]", v)


# ---- the interpolation rule (scalar) -------------------------------------------------------------
def _axis_expr(name: str) -> str:
    """An axis as a Python expression in `s`, from validated names only (TABLE_X, TABLE_Y,
    SPLINE_X): it reads its fields unconditionally (see the module docstring)."""
    if name == "kv_per_token":
        return "s.kv_read_tokens / (s.num_tokens or 1)"
    if name == "kv_per_req":
        return "s.kv_read_tokens / (s.num_reqs or 1)"
    if name not in SPLINE_X:
        raise ValueError(f"unknown axis {name!r}")
    return f"s.{name}"


# One segment lookup of the rule, inlined twice in a table: segment index clamped to the grid,
# weight clamped at 0 below the first value and free above the last.
_SEGMENT = """
    {v} = {expr}
    {i} = bisect_right({vs}, {v}) - 1
    {i} = 0 if {i} < 0 else ({last} if {i} > {last} else {i})
    {t} = ({v} - {vs}[{i}]) / ({vs}[{i} + 1] - {vs}[{i}])
    if {t} < 0.0:
        {t} = 0.0"""
_TABLE = """def table(s):{x}{y}
    r0, r1 = ms[i], ms[i + 1]
    a = r0[j] + ty * (r0[j + 1] - r0[j])
    b = r1[j] + ty * (r1[j + 1] - r1[j])
    return a + tx * (b - a)
"""
_SPLINE = """def spline(s):{x}
    return ms[i] + u * (ms[i + 1] - ms[i])
"""


def _axis_fields(name: str) -> frozenset[str]:
    """The shape fields an axis reads (`_axis_expr`)."""
    if name == "kv_per_token":
        return frozenset(("kv_read_tokens", "num_tokens"))
    if name == "kv_per_req":
        return frozenset(("kv_read_tokens", "num_reqs"))
    return frozenset((name,))


class Const:
    """A cost that is one number for every shape of a fast-path key (`keyed`'s answer for a
    term whose every input the key fixes): `value`, which a compiled model inlines as a
    literal (repr gives the float back to the bit)."""

    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, s: Any) -> float:
        return self.value


def _segment_at(
    segment: str, names: tuple[str, str], s: Any, env: dict[str, Any]
) -> tuple[int, float]:
    """(segment index, weight) of one `_SEGMENT` lookup at shape `s`: the same source over the
    same axis values (`env`), so the same float operations, as the table's own."""
    src = f"def seg(s):{segment}\n    return {names[0]}, {names[1]}"
    return _build(src, "seg", env)(s)  # type: ignore[return-value]


def _keyed_table(t: Mapping[str, Any], full: ShapeFn, env: dict[str, Any], segs: tuple[str, str]):
    """`compile_table(t).keyed`: for the shapes whose `fixed` fields are `shape`'s, a table
    whose lookup along an axis the key fixes is done once (its index and weight as literals),
    or a Const when it fixes both: the same value to the bit."""
    x_seg, y_seg = segs

    def keyed(shape: Any, fixed: Any) -> ShapeFn:
        fx = _axis_fields(t["x"]) <= set(fixed)
        fy = _axis_fields(t["y"]) <= set(fixed)
        if fx and fy:
            return Const(full(shape))
        if not (fx or fy):
            return full
        x, y = x_seg, y_seg
        if fx:
            i, tx = _segment_at(x_seg, ("i", "tx"), shape, env)
            x = f"\n    i = {i}\n    tx = {tx!r}"
        else:
            j, ty = _segment_at(y_seg, ("j", "ty"), shape, env)
            y = f"\n    j = {j}\n    ty = {ty!r}"
        return _build(_TABLE.format(x=x, y=y), "table", env)

    return keyed


def _build(src: str, name: str, env: dict[str, Any]) -> ShapeFn:
    scope: dict[str, Any] = {"__builtins__": {}, "bisect_right": bisect_right, **env}
    exec(src, scope)  # noqa: S102 - source built from fixed templates and validated names
    fn: ShapeFn = scope[name]
    return fn


def compile_table(t: Mapping[str, Any]) -> ShapeFn:
    """The bilinear table as one function of a shape (validated input)."""
    xs = tuple(float(v) for v in t["xs"])
    ys = tuple(float(v) for v in t["ys"])
    ms = tuple(tuple(float(v) for v in row) for row in t["ms"])
    x = _SEGMENT.format(v="x", expr=_axis_expr(t["x"]), i="i", vs="xs", last=len(xs) - 2, t="tx")
    y = _SEGMENT.format(v="y", expr=_axis_expr(t["y"]), i="j", vs="ys", last=len(ys) - 2, t="ty")
    env = {"xs": xs, "ys": ys, "ms": ms}
    fn = _build(_TABLE.format(x=x, y=y), "table", env)
    fn.keyed = _keyed_table(t, fn, env, (x, y))  # type: ignore[attr-defined]
    return fn


def compile_spline(t: Mapping[str, Any]) -> ShapeFn:
    """The linear spline as one function of a shape (validated input)."""
    ks = tuple(float(v) for v in t["knots"])
    ms = tuple(float(v) for v in t["ms"])
    x = _SEGMENT.format(v="x", expr=_axis_expr(t["x"]), i="i", vs="ks", last=len(ks) - 2, t="u")
    fn = _build(_SPLINE.format(x=x), "spline", {"ks": ks, "ms": ms})
    fields = _axis_fields(t["x"])

    def keyed(shape: Any, fixed: Any) -> ShapeFn:  # its one axis fixed: one number
        return Const(fn(shape)) if fields <= set(fixed) else fn

    fn.keyed = keyed  # type: ignore[attr-defined]
    return fn


# ---- the same rule on numpy columns --------------------------------------------------------------
def axis_values(name: str, cols: Cols) -> np.ndarray:
    """An axis (TABLE_X, TABLE_Y or a field) on columns holding the shape fields + num_tokens."""
    if name == "kv_per_token":
        return cols["kv_read_tokens"] / np.maximum(cols["num_tokens"], 1)
    if name == "kv_per_req":
        return cols["kv_read_tokens"] / np.maximum(cols["num_reqs"], 1)
    return np.asarray(cols[name], np.float64)


def _segments(vs: Sequence[float], v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(vs, np.float64)
    i = np.clip(np.searchsorted(a, v, side="right") - 1, 0, len(a) - 2)
    t = np.maximum((v - a[i]) / (a[i + 1] - a[i]), 0.0)
    return i, t


def spline_weights(knots: Sequence[float], x: np.ndarray) -> np.ndarray:
    """(n, len(knots)) hat-basis weights of the spline rule: value = weights @ ms."""
    i, u = _segments(knots, np.asarray(x, np.float64))
    w = np.zeros((len(x), len(knots)))
    rows = np.arange(len(x))
    np.add.at(w, (rows, i), 1.0 - u)
    np.add.at(w, (rows, i + 1), u)
    return w


def table_weights(xs: Sequence[float], ys: Sequence[float], x: np.ndarray, y: np.ndarray):
    """(n, len(xs) * len(ys)) weights of the bilinear rule on the flattened ms (row-major by
    x): value = weights @ ms.ravel()."""
    wx = spline_weights(xs, x)
    wy = spline_weights(ys, y)
    return (wx[:, :, None] * wy[:, None, :]).reshape(len(x), -1)


def table_values(t: Mapping[str, Any], cols: Cols) -> np.ndarray:
    """The table on every row (O(rows) memory: no weight matrix)."""
    i, tx = _segments(t["xs"], axis_values(t["x"], cols))
    j, ty = _segments(t["ys"], axis_values(t["y"], cols))
    m = np.asarray(t["ms"], np.float64)
    a = m[i, j] + ty * (m[i, j + 1] - m[i, j])
    b = m[i + 1, j] + ty * (m[i + 1, j + 1] - m[i + 1, j])
    return a + tx * (b - a)


def spline_values(t: Mapping[str, Any], cols: Cols) -> np.ndarray:
    i, u = _segments(t["knots"], axis_values(t["x"], cols))
    m = np.asarray(t["ms"], np.float64)
    return m[i] + u * (m[i + 1] - m[i])
