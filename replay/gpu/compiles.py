"""Count Triton JIT compiles while a part of a replay runs (the warm-up, the measured run).

Triton calls `knobs.runtime.jit_cache_hook` before and `jit_post_compile_hook` after it builds a
kernel specialization that its in-memory cache lacks (Triton >= 3.4, 3.6 on the GPU host; older
versions: `JITFunction.cache_hook` / `compiled_hook`). That is one "compile" here whether the
binary comes from the compiler or from Triton's on-disk cache: either stalls the step that meets
it (milliseconds to seconds). The hooks run only on a cache miss, never per launch, so counting
costs a measured run nothing. Hooks another library installed are chained, not replaced, and put
back on exit.

Where no Triton kernel can run (the "torch" attention backend: CPU) the count is not 0 but
"not applicable": `summary()` says so and why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

MAX_LISTED = 20  # compiles listed one by one (name, seconds, specialization) in the summary


@dataclass
class Compile:
    name: str  # module.qualname of the @triton.jit function
    seconds: float  # from the request to the kernel being ready (queueing included when async)
    signature: str  # Triton's repr of the specialization (argument types, constexprs, options)


def _hook_slots() -> tuple[Any, str, str] | None:
    """(object, pre-compile attribute, post-compile attribute) of this Triton, or None."""
    try:
        import triton  # lazy on purpose: no Triton means no counter, not an error
    except ImportError:
        return None
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
        return runtime, "jit_cache_hook", "jit_post_compile_hook"
    from triton.runtime.jit import JITFunction  # older Triton only: the hook's other home

    if hasattr(JITFunction, "compiled_hook"):
        return JITFunction, "cache_hook", "compiled_hook"
    return None


@dataclass
class CompileCounter:
    """`with CompileCounter(applicable): ...` records every compile inside the block."""

    applicable: bool = True
    why_not: str = ""  # when not applicable
    compiles: list[Compile] = field(default_factory=list)
    _open: dict[tuple[str, str], float] = field(default_factory=dict)  # (name, key) -> start
    _slots: tuple[Any, str, str] | None = None
    _prev: tuple[Any, Any] = (None, None)

    @staticmethod
    def for_engine(engine: Any) -> CompileCounter:
        """Applicable iff the engine's model launches Triton kernels on a CUDA device."""
        if engine.device.type != "cuda":
            return CompileCounter(False, f"device {engine.device.type}: no Triton kernels run")
        if getattr(engine.model, "kernels", None) is None:
            return CompileCounter(False, "attention backend 'torch': no Triton kernels run")
        return CompileCounter(True)

    def __enter__(self) -> CompileCounter:
        if not self.applicable:
            return self
        self._slots = _hook_slots()
        if self._slots is None:
            self.applicable, self.why_not = False, "this Triton has no compile hooks"
            return self
        obj, pre, post = self._slots
        self._prev = (getattr(obj, pre), getattr(obj, post))
        setattr(obj, pre, self._pre)
        setattr(obj, post, self._post)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._slots is not None:
            obj, pre, post = self._slots
            setattr(obj, pre, self._prev[0])
            setattr(obj, post, self._prev[1])
            self._slots = None

    @staticmethod
    def _name(kw: dict[str, Any]) -> str:
        fn = kw.get("fn")
        return f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}"

    def _pre(self, **kw: Any) -> Any:
        prev = self._prev[0]
        skip = prev(**kw) if prev is not None else None
        if not skip:  # a truthy answer makes Triton skip the compile: nothing to time
            # the first request counts (an asynchronous compile is requested at every launch
            # until it is done, and finishes once)
            self._open.setdefault((self._name(kw), str(kw.get("key"))), time.perf_counter())
        return skip

    def _post(self, **kw: Any) -> Any:
        t1 = time.perf_counter()
        name = self._name(kw)
        t0 = self._open.pop((name, str(kw.get("key"))), t1)
        self.compiles.append(Compile(name, t1 - t0, str(kw.get("repr", ""))))
        prev = self._prev[1]
        return prev(**kw) if prev is not None else None

    @property
    def count(self) -> int | None:
        return len(self.compiles) if self.applicable else None

    def summary(self) -> dict[str, Any]:
        """{"applicable", "count", "seconds", "by_kernel": {name: {"count", "seconds"}},
        "first": [{"name", "seconds", "signature"}...]} or {"applicable": false, "why_not"}."""
        if not self.applicable:
            return {"applicable": False, "count": None, "why_not": self.why_not}
        by_kernel: dict[str, dict[str, float]] = {}
        for c in self.compiles:
            k = by_kernel.setdefault(c.name, {"count": 0, "seconds": 0.0})
            k["count"] += 1
            k["seconds"] += c.seconds
        return {
            "applicable": True,
            "count": len(self.compiles),
            "seconds": sum(c.seconds for c in self.compiles),
            "by_kernel": dict(sorted(by_kernel.items())),
            "first": [
                {"name": c.name, "seconds": c.seconds, "signature": c.signature[:400]}
                for c in self.compiles[:MAX_LISTED]
            ],
        }
