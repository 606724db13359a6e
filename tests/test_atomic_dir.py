"""bubblesim.core.atomic.replacing_dir: a folder is replaced whole or not at all (the folder form of
`replacing`, used by bubblesim.core.outplace.atomic_dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bubblesim.core import atomic


def test_replacing_dir_swaps_in_the_whole_folder(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic.replacing_dir(target) as tmp:
        (tmp / "new.txt").write_text("new")
        assert (target / "old.txt").exists()  # not in place until the block ends
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp, no aside left


def test_replacing_dir_leaves_the_old_folder_when_the_block_fails(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic.replacing_dir(target) as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("stop")
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_replacing_dir_creates_a_new_folder(tmp_path: Path) -> None:
    with atomic.replacing_dir(tmp_path / "fresh") as tmp:
        (tmp / "a").write_text("a")
    assert (tmp_path / "fresh" / "a").read_text() == "a"
