"""Replace a folder whole or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def swap_in(tmp: Path, target: Path) -> None:
    """Rename the finished folder `tmp` to `target` (same parent). A previous `target` is moved
    aside first, put back if the rename fails, and deleted after: at no moment is there a
    half-written `target`."""
    if not target.exists():
        os.rename(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, old / "previous")
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old / "previous", target)
        raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
