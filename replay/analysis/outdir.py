"""Write a whole output folder or none of it: build it in a temp folder beside the target, then
rename it into place. A previous folder of the same kind (it holds `marker`) is replaced; any
other non-empty folder is refused, never overwritten (the rule of bubblesim.core.outplace)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.parquet as pq

from bubblesim.core import outplace
from bubblesim.core.atomic import atomic_file
from bubblesim.core.outplace import OutKind
from replay.analysis.idlegap_file import META_KEY as IDLEGAP_META_KEY
from replay.analysis.sampling_file import META_KEY as SAMPLING_META_KEY
from replay.analysis.shapes_file import META_KEY

__all__ = [
    "ABLATE_FOLDER",
    "FIDELITY_FOLDER",
    "IDLEGAP_FILE",
    "PROFILE_FILE",
    "SAMPLING_FILE",
    "SHAPES_FILE",
    "atomic_dir",
    "atomic_file",
    "folder_kind",
]


def folder_kind(marker: str, what: str | None = None) -> OutKind:
    return OutKind(what or f"{marker} folder", folder=True, markers=(marker,))


@contextlib.contextmanager
def atomic_dir(out: str | Path, marker: str) -> Iterator[Path]:
    with outplace.atomic_dir(out, folder_kind(marker)) as tmp:
        yield tmp


def _is_profile(p: Path) -> bool:
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "version" in data and "source_runs" in data


def _parquet_with(key: bytes) -> Callable[[Path], bool]:
    """A recogniser: a parquet file whose schema metadata holds `key`."""

    def recognise(p: Path) -> bool:
        try:
            meta = pq.read_schema(p).metadata or {}
        except Exception:  # noqa: BLE001 - not parquet at all
            return False
        return key in meta

    return recognise


def _is_ablation(p: Path) -> bool:
    """ablate.json, or (an interrupted ablation) a `<switch>-off`/`-on` run folder."""
    if (p / "ablate.json").exists():
        return True
    return any(c.is_dir() and c.name.endswith(ABLATE_SIDES) for c in p.iterdir())


ABLATE_SIDES = ("-off", "-on", "-off.sim", "-on.sim")
FIDELITY_FOLDER = folder_kind("fidelity.json", "fidelity folder")
ABLATE_FOLDER = OutKind("ablation folder", folder=True, recognise=_is_ablation)
PROFILE_FILE = OutKind("cost profile", folder=False, recognise=_is_profile)
SHAPES_FILE = OutKind("shape sweep", folder=False, recognise=_parquet_with(META_KEY))
IDLEGAP_FILE = OutKind(
    "sweep of idle gaps", folder=False, recognise=_parquet_with(IDLEGAP_META_KEY)
)
SAMPLING_FILE = OutKind("sampling sweep", folder=False, recognise=_parquet_with(SAMPLING_META_KEY))
