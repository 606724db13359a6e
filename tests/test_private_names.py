"""No module of bubblesim/core/, sim/, replay/, engine/, bench/ (nor the scripts of reports/ and
traces/)
reaches into another module's private names (a leading underscore): read with `ast`, nothing
is imported. Caught:

- `from pkg.mod import _name` (and relative forms), `import pkg._mod`;
- `mod._name` where `mod` is a project module bound by an import;
- `obj._name` where `obj` is not `self`/`cls` and no code of this module defines `_name` (a
  `def`/class/class-body name, or a `self._name = ...` assignment): the name belongs to a class
  of another module.

Third-party privates (`torch.cuda._sleep`, `argparse._SubParsersAction`) are not this rule's
business. ALLOWED lists the reach-ins left in files other work owns; each entry names the file
and the private name, and the list only shrinks (an entry that no longer matches fails too).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bubblesim", "sim", "replay", "engine", "bench", "reports", "traces")
# namedtuple's public API, spelled with an underscore so it cannot clash with field names
PUBLIC_UNDERSCORE = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}

# (file, private name): reach-ins left in files other work owns (issue 15 emptied it)
ALLOWED: set[tuple[str, str]] = set()


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORE


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_project_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def absolute(node: ast.ImportFrom, path: Path) -> str:
    if not node.level:
        return node.module or ""
    pkg = module_name(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    base = pkg[: len(pkg) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def defined_privates(tree: ast.Module) -> set[str]:
    """Private names this module's own code defines."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)  # __slots__ entries
    return {n for n in out if is_private(n)}


def reach_ins(path: Path) -> list[tuple[int, str, str]]:
    """(line, private name, what) of each cross-module private access in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    project_aliases: set[str] = set()  # local names bound to project modules
    foreign_roots: set[str] = set()  # local names bound to third-party modules or their members
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                for part in a.name.split("."):
                    if is_private(part):
                        found.append((node.lineno, part, f"import {a.name}"))
                local = a.asname or a.name.split(".")[0]
                target = a.name if a.asname else local
                (project_aliases if is_project_module(target) else foreign_roots).add(local)
        elif isinstance(node, ast.ImportFrom):
            mod = absolute(node, path)
            project = is_project_module(mod.split(".")[0]) if mod else False
            for part in mod.split("."):
                if is_private(part):
                    found.append((node.lineno, part, f"from {mod} import"))
            for a in node.names:
                if project and is_private(a.name):
                    found.append((node.lineno, a.name, f"from {mod} import {a.name}"))
                local = a.asname or a.name
                if project and is_project_module(f"{mod}.{a.name}"):
                    project_aliases.add(local)
                elif not project:
                    foreign_roots.add(local)
    own = defined_privates(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not is_private(node.attr):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        root = base
        while isinstance(root, ast.Attribute | ast.Call | ast.Subscript):
            root = root.func if isinstance(root, ast.Call) else root.value
        if isinstance(root, ast.Name) and root.id in foreign_roots:
            continue
        module_attr = isinstance(base, ast.Name) and base.id in project_aliases
        if module_attr or node.attr not in own:
            found.append((node.lineno, node.attr, ast.unparse(node)))
    return found


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_module_reaches_into_another_modules_private_names():
    files = sources()
    assert len(files) > 150  # the walk found the packages
    bad, used = [], set()
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line, name, what in reach_ins(path):
            if (rel, name) in ALLOWED:
                used.add((rel, name))
            else:
                bad.append(f"{rel}:{line}: {what}")
    assert not bad, "private names used across modules (make them public):\n" + "\n".join(bad)
    stale = sorted(ALLOWED - used)
    assert not stale, f"ALLOWED entries that no longer occur (remove them): {stale}"


def test_the_checker_sees_each_kind_of_reach_in(tmp_path: Path, monkeypatch):
    probe = ROOT / "sim" / "_probe_private_names.py"  # read only, never imported
    text = (
        "import bubblesim.core.runfmt.bubbles as b\n"
        "from bubblesim.core.runfmt.bubbles import _empty\n"
        "from .loop import _EMPTY\n"
        "import torch\n"
        "class A:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def f(self, other, rec):\n"
        "        torch.cuda._sleep(1)\n"
        "        return other._mine, b._gpu_intervals, rec._arrival, self._x, t._replace()\n"
    )
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text)
    got = sorted((name, what) for _, name, what in reach_ins(probe))
    assert got == [
        ("_EMPTY", "from sim.loop import _EMPTY"),
        ("_arrival", "rec._arrival"),
        ("_empty", "from bubblesim.core.runfmt.bubbles import _empty"),
        ("_gpu_intervals", "b._gpu_intervals"),
    ]
