"""Imports sit at the top of each module of bubblesim/core/, replay/ and bench/, so what a module
needs
(torch, Triton, pyarrow) shows where a reader looks first. An import inside a function is
allowed only when it is deliberately lazy (a GPU-only or optional dependency, or one that
`--help` must not pay for) and says why: a comment on one of its lines or on the line just
above it; the imports right after it in the same block share that comment."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bubblesim/core", "replay", "bench")
# files other work owns (issue 15): their function-level imports move when that work lands
# (an entry whose file has none left fails: remove it)
OWNED_ELSEWHERE = {
    "bench/sim_speed.py",  # helper `speed`: lookalike() and child() import lazily, uncommented
}


def comment_lines(text: str) -> set[int]:
    return {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    }


def uncommented_lazy_imports(text: str) -> list[tuple[int, str]]:
    """(line, source) of each import inside a function with no comment saying why."""
    tree, comments = ast.parse(text), comment_lines(text)
    lines = text.splitlines()
    in_functions = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    bad = []
    for block in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(block, field, None)
            prev_ok, prev_end = False, -1  # the previous statement: a commented import above
            for stmt in stmts if isinstance(stmts, list) else []:
                if id(stmt) not in in_functions:
                    prev_ok = False
                    continue
                end = stmt.end_lineno or stmt.lineno
                ok = bool(set(range(stmt.lineno - 1, end + 1)) & comments)
                ok = ok or (prev_ok and prev_end == stmt.lineno - 1)
                if not ok:
                    bad.append((stmt.lineno, lines[stmt.lineno - 1].strip()))
                prev_ok, prev_end = ok, end
    return bad


def test_every_function_level_import_says_why_it_is_lazy():
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(files) > 60  # the walk found the packages
    bad, elsewhere = [], set()
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        found = [f"{rel}:{n}: {src}" for n, src in uncommented_lazy_imports(path.read_text())]
        if rel in OWNED_ELSEWHERE:
            elsewhere.update([rel] if found else [])
        else:
            bad += found
    assert elsewhere == OWNED_ELSEWHERE, f"nothing left to allow in {OWNED_ELSEWHERE - elsewhere}"
    assert not bad, "imports inside functions: move to the top, or comment why lazy:\n" + "\n".join(
        bad
    )


def test_the_check_tells_a_commented_lazy_import_from_a_hidden_one():
    text = (
        "import os\n"
        "def a():\n"
        "    # lazy: torch only on the GPU path\n"
        "    import torch\n"
        "    from torch import nn\n"
        "\n"
        "    import json\n"
        "def b():\n"
        "    import numpy as np  # optional dependency\n"
        "    if np:\n"
        "        import scipy\n"
        "    return os\n"
    )
    assert uncommented_lazy_imports(text) == [(7, "import json"), (11, "import scipy")]
