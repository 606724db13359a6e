"""One way to write a file or folder whole: bubblesim.core.atomic. No module builds its own temp and
renames it into place (each did once, each slightly differently: temp names the sweep of dead
processes' temps could not see, 0600 modes, temps left behind on failure)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from bubblesim.core import atomic

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("bubblesim", "sim", "replay", "engine", "traces", "bench")
# a temp made or renamed into place by hand: a call, not a word in a docstring
STRAY = re.compile(r"\b(mkstemp|mkdtemp|NamedTemporaryFile|os\.replace|os\.rename)\(")
# path -> why it may keep such a call
ALLOWED = {
    "bubblesim/core/atomic.py": "the helpers themselves",
    "bench/plan_sweep.py": "mkdtemp: a scratch folder for the benchmark's cut trace and points "
    "store, not an output written into place",
}


def _sources() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def test_no_hand_made_temp_then_rename_outside_core_atomic() -> None:
    stray = []
    for p in _sources():
        rel = p.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if STRAY.search(line):
                stray.append(f"{rel}:{n}: {line.strip()}")
    assert not stray, (
        "write through bubblesim.core.atomic (replacing, atomic_file, temp_dir + swap_in):\n"
        + ("\n".join(stray))
    )


def test_allow_list_is_not_stale() -> None:
    for rel in ALLOWED:
        assert STRAY.search((ROOT / rel).read_text()), f"{rel} no longer needs its exemption"


def test_replacing_writes_whole_with_umask_mode(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    target.write_text("old")
    old_mask = os.umask(0o027)
    try:
        with atomic.replacing(target) as tmp:
            tmp.write_text("new")
            assert target.read_text() == "old"  # not in place until the block ends
    finally:
        os.umask(old_mask)
    assert target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o640
    assert os.listdir(tmp_path) == ["x.json"]


def test_replacing_leaves_the_old_file_and_no_temp_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic.replacing(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["x.json"]


def test_move_aside_and_put_back(tmp_path: Path) -> None:
    target = tmp_path / "run"
    target.mkdir()
    (target / "a").write_text("1")
    old = atomic.move_aside(target)
    assert not target.exists() and (old / "previous" / "a").read_text() == "1"
    atomic.put_back(old, target)
    assert (target / "a").read_text() == "1"


def test_plan_worker_reads_trace_bytes_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    import numpy as np

    from bubblesim.core.trace import make_trace, trace_sha256, write_trace
    from bubblesim.plan import worker

    src = write_trace(make_trace([0.0, 0.5], [16, 32], [4, 8]), tmp_path / "t.parquet")
    sha = trace_sha256(src)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(worker, "_TRACES", {})
    got = worker._trace(str(tmp_path / "elsewhere.parquet"), sha, src.read_bytes())
    assert np.array_equal(got.prompt_len, [16, 32])
    assert os.listdir(scratch) == []  # the bytes' temp copy is gone once read


@pytest.mark.parametrize("what", ["dir", "file"])
def test_a_temp_made_as_an_interrupt_arrives_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """SIGTERM's handler (or Ctrl-C's) runs right after the system call that made the temp:
    the exception it raises reaches temp_dir / temp_file before the caller knows the path."""
    made: list[str] = []
    real = os.mkdir if what == "dir" else os.open

    def then_interrupted(path: Any, *args: Any) -> Any:
        out = real(path, *args)
        made.append(str(path))
        if what == "file":
            os.close(out)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "mkdir" if what == "dir" else "open", then_interrupted)
    target = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        if what == "dir":
            atomic.temp_dir(target)
        else:
            with atomic.temp_file(target):
                pass
    monkeypatch.undo()
    assert made and os.listdir(tmp_path) == []
