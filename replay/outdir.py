"""Write a whole output folder or none of it: build it in a temp folder beside the target, then
rename it into place. A previous folder of the same kind (it holds `marker`) is replaced; any
other non-empty folder is refused, never overwritten."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from core.atomic import swap_in
from core.cli import UsageError


@contextlib.contextmanager
def atomic_dir(out: str | Path, marker: str) -> Iterator[Path]:
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise UsageError(f"'{target}' exists and is not a folder")
    if target.is_dir() and any(target.iterdir()) and not (target / marker).exists():
        raise UsageError(f"'{target}' exists and holds no {marker}; not replacing it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_file(path: str | Path, text: str) -> Path:
    """Write a text file whole or not at all (temp file in the same folder, then rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
