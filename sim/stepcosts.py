"""A step's costs as one list (sim.clock.COSTS order), from its batch shape.

`StepCosts.all(shape)` is what the step loop takes for every step; the fast path (sim.fast)
takes the same functions for runs of decode steps, caching every value that cannot change
between two steps with the same cache key. Which those are is found out, not listed: a cost
function is called once on a `Probe` of the step's shape, which notes whether it read a field
other than KEY_FIELDS (the fields the cache key fixes: set by `StepShape.set_decode` /
`set_verify`). A cost that reads any other field, including one added to BatchShape later,
is called again at every step; nothing is cached on a field the key does not fix. The probe
is sound because a cost is a function of the shape alone: what it reads on the way to its
value decides the value. A varying cost with a `keyed(shape, KEY_FIELDS)` method (the
roofline, compiled linear models, a profile's compiled decode model with its tables and
splines, and the wrappers around it: the verify dispatch, the penalties' history term, random
sampling's term) is called through its specialisation for the key, which folds the fixed
fields' terms in once and gives the same value to the bit. `all` (any shape)
takes the same probe with no field fixed: a cost that reads no field has one value.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from bubblesim.core import phases as P
from bubblesim.core.shape import SHAPE_FIELDS, BatchShape
from sim.clock import COSTS, NUM_SECONDS
from sim.cost import CostModel
from sim.cost.linear import EXPR_ATTR

CostFn = Callable[[Any], Any]
# StepShape.set_row unpacks a row in this order
assert SHAPE_FIELDS == (
    "num_reqs", "num_prefill_reqs", "prefill_tokens", "decode_tokens", "draft_tokens",
    "kv_read_tokens", "attn_pairs", "max_kv_tokens", "history_tokens", "context_tokens",
    "new_reqs", "finished_reqs",
), SHAPE_FIELDS  # fmt: skip
_GPU = COSTS.index("gpu_s")
# the fields a fast-path cache key (batch size; with drafts also query and draft tokens)
# fixes for a step with no prefill, and what follows from them; every other field varies
KEY_FIELDS = frozenset(
    ("num_reqs", "num_prefill_reqs", "prefill_tokens", "decode_tokens", "draft_tokens",
     "new_reqs", "finished_reqs", "num_tokens", "is_pure_decode")
)  # fmt: skip


def _keyed(fn: CostFn, shape: StepShape) -> CostFn:
    """`fn` for the shapes whose KEY_FIELDS are `shape`'s: its own specialisation where it
    has one (`fn.keyed(shape, KEY_FIELDS)`: sim.cost.roofline.Roofline.keyed,
    sim.cost.linear.keyed_linear; the same value to the bit, fewer operations per step),
    else `fn`."""
    keyed = getattr(fn, "keyed", None)
    return fn if keyed is None else keyed(shape, KEY_FIELDS)


Setter = Callable[[Any, list[Any]], None]


def _setter(costs: list[tuple[int, CostFn, bool]]) -> Setter:
    """One function `set(shape, out)` doing `out[i] = fn(shape) / 1e3 if in_ms else
    fn(shape)` for each (i, fn, in_ms) of `costs`, in order: a compiled linear model
    (sim.cost.linear.compile_linear: its expression, EXPR_ATTR, reads only `s` and float
    literals) is inlined, evaluated with the same operations in the same order (the same value
    to the bit, without its call); any other function is called."""
    env: dict[str, Any] = {"__builtins__": {}, "round": round}
    lines = []
    for i, fn, in_ms in costs:
        expr = getattr(fn, EXPR_ATTR, None)
        if expr is None:
            env[f"_f{i}"] = fn
            value = f"_f{i}(s)"
        else:
            value = f"({expr})"
        lines.append(f"    out[{i}] = {value} / 1e3" if in_ms else f"    out[{i}] = {value}")
    namespace: dict[str, Any] = {}
    exec("def set(s, out):\n" + ("\n".join(lines) or "    pass"), env, namespace)  # noqa: S102
    setter: Setter = namespace["set"]
    return setter


class StepShape:
    """A mutable BatchShape stand-in: the shape of a fast-path step, set field by field."""

    __slots__ = (*SHAPE_FIELDS, "num_tokens", "is_pure_decode")

    def __init__(self) -> None:
        self.set_decode(0)
        self.kv_read_tokens = 0
        self.attn_pairs = 0
        self.max_kv_tokens = 0
        self.history_tokens = 0
        self.context_tokens = 0

    def set_decode(self, b: int) -> None:
        """KEY_FIELDS of a decode of b requests."""
        self.num_reqs = b
        self.num_prefill_reqs = 0
        self.prefill_tokens = 0
        self.decode_tokens = b
        self.draft_tokens = 0
        self.new_reqs = 0
        self.finished_reqs = 0
        self.num_tokens = b
        self.is_pure_decode = b > 0

    def set_verify(self, b: int, tokens: int, drafts: int) -> None:
        """KEY_FIELDS of a speculative verify step: b decodes, `drafts` of whose `tokens`
        query tokens are drafts."""
        self.set_decode(b)
        self.decode_tokens = self.num_tokens = tokens
        self.draft_tokens = drafts

    def set_row(self, row: tuple[int, ...]) -> None:
        """Every field, from values in SHAPE_FIELDS order."""
        (
            self.num_reqs, self.num_prefill_reqs, self.prefill_tokens, self.decode_tokens,
            self.draft_tokens, self.kv_read_tokens, self.attn_pairs, self.max_kv_tokens,
            self.history_tokens, self.context_tokens, self.new_reqs, self.finished_reqs,
        ) = row  # fmt: skip
        self.num_tokens = self.prefill_tokens + self.decode_tokens
        self.is_pure_decode = self.num_prefill_reqs == 0 and self.num_reqs > 0


class Probe:
    """Reads through to a shape and notes whether a field outside KEY_FIELDS was read."""

    def __init__(self, shape: StepShape | BatchShape, fixed: frozenset[str] = KEY_FIELDS) -> None:
        """`fixed`: the fields whose reading does not make the cost varying."""
        self._shape = shape
        self._fixed = fixed
        self.varying = False

    def __getattr__(self, name: str) -> Any:
        if name not in self._fixed:
            self.varying = True
        return getattr(self._shape, name)


class StepCosts:
    """The cost model's answers for one step, in sim.clock.COSTS order: the CPU phases'
    seconds (launch: cpu_phase_ms + launch_ms), the GPU pass's and drafter's seconds, each
    phase's net tracked objects, and whether the forward is one CUDA graph."""

    def __init__(self, cost: CostModel, cuda_graphs: bool) -> None:
        launch_fn = cost.phase_ms_fn(P.LAUNCH)

        def launch_ms(s: Any) -> float:  # cpu_phase_ms(LAUNCH) + launch_ms
            return launch_fn(s) + cost.launch_ms(s, cuda_graphs)

        def alloc(p: str) -> CostFn:  # cost.alloc_objects(p, ·)
            fn = cost.alloc_objects_fn(p)
            rounded = lambda s: round(fn(s))  # noqa: E731
            expr = getattr(fn, EXPR_ATTR, None)
            if expr is not None:  # (what `_setter` inlines)
                setattr(rounded, EXPR_ATTR, f"round({expr})")  # noqa: B010
            return rounded

        def graphed(s: Any) -> bool:
            return cost.graphed(s, cuda_graphs)

        phases: list[CostFn] = [
            launch_ms if p == P.LAUNCH else cost.phase_ms_fn(p) for p in P.CPU_PHASES
        ]
        rest: list[CostFn] = [cost.draft_gpu_ms_fn(), *(alloc(p) for p in P.CPU_PHASES), graphed]
        self.fns = [*phases, cost.gpu_pass_ms, *rest]  # any shape
        self._ms_fns, self._other_fns = self.fns[:NUM_SECONDS], self.fns[NUM_SECONDS:]
        self.decode_fns = [*phases, cost.gpu_decode_ms_fn(), *rest]  # shapes without a prefill
        self._sched_ms, self._sched_objs = phases[0], rest[1]
        self._const: dict[Hashable, list[Any]] = {}
        self._varying: dict[Hashable, list[tuple[int, CostFn, bool]]] = {}
        self._set_varying: dict[Hashable, Setter] = {}
        # `all`: the costs that read no field (their values), and a setter of those that read
        self._template: list[Any] | None = None
        self._set_all: Setter | None = None

    def all(self, shape: BatchShape | StepShape) -> list[Any]:
        """Every cost of a step that runs a pass: the costs that read no field of the shape
        (found by a probe at the first call: the same value for every shape) are copied from
        a template, the rest set by one call (`_setter`)."""
        if self._set_all is None:
            self._probe_all(shape)
        out = self._template.copy()  # type: ignore[union-attr]
        self._set_all(shape, out)  # type: ignore[misc]
        return out

    def _probe_all(self, shape: BatchShape | StepShape) -> None:
        """Sort `fns` into those that read a field of `shape` (set by `all` at every step)
        and those that read none (their value, kept in the template)."""
        template: list[Any] = []
        reads: list[tuple[int, CostFn, bool]] = []
        for i, fn in enumerate(self.fns):
            probe = Probe(shape, frozenset())
            value = fn(probe)
            if probe.varying:
                template.append(None)
                reads.append((i, fn, i < NUM_SECONDS))
            else:
                template.append(value / 1e3 if i < NUM_SECONDS else value)
        self._template = template
        self._set_all = _setter(reads)

    def empty(self, shape: BatchShape) -> list[Any]:
        """The costs of a schedule that found nothing to run: its scan, no pass (gpu_s None)."""
        c: list[Any] = [0.0] * NUM_SECONDS + [0] * (len(self.fns) - NUM_SECONDS)
        c[0] = self._sched_ms(shape) / 1e3
        c[NUM_SECONDS] = self._sched_objs(shape)
        c[_GPU] = None
        return c

    def const(self, shape: StepShape, key: Hashable) -> list[Any]:
        """For the steps without a prefill whose KEY_FIELDS are `shape`'s (`key` must
        determine them: the batch size for plain decodes), per cost: its value (the same at
        every such step), or None where it reads a varying field (`varying(key)` says how to
        get it at a step)."""
        out = self._const.get(key)
        if out is None:
            out, varying = [], []
            for i, fn in enumerate(self.decode_fns):
                probe = Probe(shape)
                fn(probe)
                if probe.varying:
                    out.append(None)
                    varying.append((i, _keyed(fn, shape), i < NUM_SECONDS))
                else:
                    out.append(fn(shape) / 1e3 if i < NUM_SECONDS else fn(shape))
            self._const[key] = out
            self._varying[key] = varying
            self._set_varying[key] = _setter(varying)
        return out

    def varying(self, key: Hashable) -> list[tuple[int, CostFn, bool]]:
        """(index, function, in ms) of the costs `const(shape, key)` left None: at a step,
        c[index] = function(shape) / 1e3 if in ms else function(shape), as `all` takes it."""
        return self._varying[key]

    def set_varying(self, key: Hashable) -> Setter:
        """`set(shape, c)`: c[index] = function(shape) (/ 1e3 if in ms) for every cost of
        `varying(key)`, in one call (`_setter`)."""
        return self._set_varying[key]
