"""Where the tests find the public source data (the raw traces `traces/build.py` reads).

$BUBBLESIM_SHARED when set, else the repository's own `shared/` when it has one, else the
`shared/` folder beside the repository, as `traces/build.py` looks. Tests that need it skip
with `needs_shared` when it is absent, naming the folder they looked in.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]


def shared_root() -> Path:
    env = os.environ.get("BUBBLESIM_SHARED")
    if env:
        return Path(env)
    own = _ROOT / "shared"
    return own if own.is_dir() else _ROOT.parent / "shared"


SHARED_TRACES = shared_root() / "traces"


def needs_shared(*parts: str) -> pytest.MarkDecorator:
    """Skip unless SHARED_TRACES/<parts...> exists."""
    path = SHARED_TRACES.joinpath(*parts)
    return pytest.mark.skipif(
        not path.exists(), reason=f"public source data not found: {path} (set BUBBLESIM_SHARED)"
    )
