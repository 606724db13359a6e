"""replay/ is split by what it needs: replay.analysis (compare, calibrate and its fits, the sweep
format, reports) must import with torch absent, as on a machine without torch; replay.gpu runs the
engine and may import torch at the top. Each module is imported in a fresh interpreter whose
sys.modules["torch"] is None, so any `import torch` on its import path raises."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import replay.analysis

ROOT = Path(__file__).resolve().parent.parent

BLOCKED = """
import importlib, sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
for name in sys.argv[1:]:
    importlib.import_module(name)
assert sys.modules["torch"] is None
print("ok", len(sys.argv) - 1)
"""


def analysis_modules() -> list[str]:
    found = pkgutil.iter_modules(replay.analysis.__path__, "replay.analysis.")
    return sorted(m.name for m in found)


def test_every_analysis_module_imports_without_torch():
    names = analysis_modules()
    assert len(names) >= 20 and "replay.analysis.calibrate" in names
    got = subprocess.run(
        [sys.executable, "-c", BLOCKED, *names], cwd=ROOT, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == f"ok {len(names)}"


def test_the_cli_help_imports_neither_torch_nor_the_gpu_side():
    code = (
        "import sys, runpy\n"
        'sys.modules["torch"] = None\n'
        'sys.argv = ["replay", "--help"]\n'
        "try:\n"
        '    runpy.run_module("replay", run_name="__main__")\n'
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        'assert not [m for m in sys.modules if m.startswith("replay.gpu.")], sorted(sys.modules)\n'
    )
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert "usage" in got.stdout
