"""The product's import structure (issue 15): no module of its packages (bubblesim/, sim/,
replay/, engine/) imports another module's private names, and the imports between them form no
cycle (so sim/loop.py is never imported back by what it imports, nor engine/engine.py by the
tensor-parallel workers it starts). Read from the source with `ast`, every import counted:
module top, inside functions and under `if TYPE_CHECKING:` alike."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bubblesim", "sim", "replay", "engine")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) of every import in the file."""
    out = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the file's package, `level - 1` levels up
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            out.append((node.lineno, module, [a.name for a in node.names]))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the product's modules it imports (`from pkg import mod` imports mod)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for _, module, names in _imports(name, path):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            if module in modules and len(targets) < len(names) or not names:
                targets.append(module)
            for t in targets:
                if t in modules and t != name:
                    graph[name].add(t)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_no_module_imports_a_private_name() -> None:
    bad = []
    for name, path in _modules().items():
        for line, module, names in _imports(name, path):
            if module.partition(".")[0] not in PACKAGES:
                continue  # another project's (torch.distributed._symmetric_memory): its call
            taken = [n for n in names if _private(n)]
            if taken or any(_private(part) for part in module.split(".")):
                rel = path.relative_to(ROOT)
                bad.append(f"{rel}:{line}: from {module} import {', '.join(taken) or '...'}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_the_import_graph_has_no_cycle() -> None:
    graph = _edges(_modules())
    assert "sim.clock" in graph["sim.loop"] and "sim.fast" in graph["sim.loop"]  # edges seen
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_catch_what_they_look_for() -> None:
    """The detectors themselves: a private import and a two-module cycle are found."""
    assert _private("_shape") and not _private("__all__") and not _private("shape")
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
