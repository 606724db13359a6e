"""Where a command may write its output (`-o`): one rule for every command that writes.

- a path that does not exist is created (with its missing parent folders);
- an empty folder is used;
- an earlier output of the same kind (a run folder for `sim run`/`replay run`, a folder
  holding whatif.json for `sim whatif`, plan.json/points.jsonl for `sim plan`, a cost profile
  for `replay calibrate`, ...) is replaced whole at the end (`sim plan` resumes it instead);
- anything else (a file where a folder goes, a non-empty folder of another kind, an existing
  trace file: runs name their trace by sha256, so a trace is never silently replaced) is
  refused with one line, unless `--force`, which replaces it. `--force` never replaces a
  folder with a file, nor a folder that holds the current folder or the home folder.

All of it is checked before any work starts (`output_place`): a bad place costs no simulation.
If the command then fails or is interrupted, what `--force` moved aside goes back and the
parent folders made for the output are removed again (if still empty).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bubblesim.core.atomic import move_aside, put_back, replacing_dir, temp_dir
from bubblesim.core.cli import UsageError


@dataclass(frozen=True)
class OutKind:
    """What a command writes: a folder or a file, and how to recognise an earlier one."""

    what: str  # "run folder", "trace file", ...: named in refusals
    folder: bool
    markers: tuple[str, ...] = ()  # folder kinds: any of these files marks an earlier output
    recognise: Callable[[Path], bool] | None = None  # or this test

    def is_earlier_output(self, p: Path) -> bool:
        if self.recognise is not None:
            return self.recognise(p)
        return self.folder and any((p / m).exists() for m in self.markers)


def _is_run_dir(p: Path) -> bool:
    from bubblesim.core.runfmt.summary import FORMAT  # lazy: pyarrow, which `--help` does not need

    try:
        summary = json.loads((p / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("format") == FORMAT


RUN_FOLDER = OutKind("run folder", folder=True, recognise=_is_run_dir)
TRACE_FILE = OutKind("trace file", folder=False)  # never replaced without --force


def refusal(target: Path, kind: OutKind) -> str | None:
    """Why writing `kind` at `target` needs --force; None if the rule allows it."""
    if not os.path.lexists(target):
        return None
    if kind.folder:
        if not target.is_dir():
            return f"is a file, not a {kind.what}"
        if not any(target.iterdir()) or kind.is_earlier_output(target):
            return None
        return f"is a non-empty folder that is not a {kind.what}"
    if target.is_dir():
        return f"is a folder; give a file name for the {kind.what}"
    if kind.is_earlier_output(target):
        return None
    return "exists" if kind.recognise is None else f"exists and is not a {kind.what}"


def check_place(target: Path, kind: OutKind, force: bool = False) -> None:
    """Raise UsageError (one line naming `-o`) unless `kind` may be written at `target`."""
    why = refusal(target, kind)
    if why is None:
        return
    if not force or (not kind.folder and target.is_dir()):
        hint = "" if target.is_dir() and not kind.folder else "; pass --force to replace it"
        raise UsageError(f"-o '{target}' {why}{hint}")
    if target.is_dir():
        here = Path.cwd().resolve()
        real = target.resolve()
        if real == here or real in here.parents or real == Path.home().resolve():
            raise UsageError(
                f"-o '{target}': --force will not replace a folder that holds the current "
                "or home folder"
            )


def _make_parents(parent: Path, target: Path) -> list[Path]:
    """Create `parent` and its missing ancestors; the created ones, innermost first."""
    missing = []
    p = parent
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        for d in reversed(missing):
            d.mkdir()
    except BaseException as e:  # (SIGTERM's or Ctrl-C's too: raised right after a mkdir made d)
        _remove_empty(missing)
        if isinstance(e, OSError):
            raise UsageError(f"-o '{target}': cannot create folder '{d}' ({e.strerror})") from None
        raise
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for d in folders:  # innermost first
        with contextlib.suppress(OSError):
            d.rmdir()


def _probe(parent: Path, target: Path) -> None:
    """Fail now, not after the work, if nothing can be written into `parent`."""
    if not parent.is_dir():
        raise UsageError(f"-o '{target}': '{parent}' is not a folder")
    try:
        temp_dir(target).rmdir()
    except OSError as e:
        raise UsageError(f"-o '{target}': cannot write in '{parent}' ({e.strerror})") from None


@contextlib.contextmanager
def output_place(path: str | Path, kind: OutKind, force: bool = False) -> Iterator[Path]:
    """Check the place (module doc), make it ready, yield it; the block writes the output.
    On any exception (KeyboardInterrupt and SIGTERM included) what --force moved aside goes
    back where the block left nothing, and parent folders made here are removed if empty."""
    target = Path(path)
    check_place(target, kind, force)
    parent = target.parent if str(target.parent) else Path(".")
    existed = os.path.lexists(target)
    aside: Path | None = None
    created = _make_parents(parent, target)
    try:  # right after the parents are made (a signal's exception while making them undoes them)
        _probe(parent, target)
        if refusal(target, kind) is not None:  # --force: out of the way until the block ends
            aside = move_aside(target)
        yield target
    except BaseException as e:
        if aside is not None:
            if not os.path.lexists(target):
                put_back(aside, target)
            shutil.rmtree(aside, ignore_errors=True)
        _remove_empty([target] if not existed and target.is_dir() else [])
        _remove_empty(created)
        if isinstance(e, OSError) and _writing(e, target):  # disk full, quota, ...
            raise UsageError(f"-o '{target}': cannot write ({e.strerror or e})") from None
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _writing(e: OSError, target: Path) -> bool:
    """The error is about the output, a path in it, or one of its temps (`.<name>.*` beside
    it), not about an input."""
    if not e.filename:
        return False
    f = Path(os.fsdecode(e.filename)).absolute()
    t = target.absolute()
    return any(
        p == t or (p.parent == t.parent and p.name.startswith(f".{t.name}."))
        for p in (f, *f.parents)
    )


@contextlib.contextmanager
def atomic_dir(out: str | Path, kind: OutKind) -> Iterator[Path]:
    """Build a folder in a temp folder beside `out` and swap it in whole
    (bubblesim.core.atomic.replacing_dir); on any exception the temp folder goes and `out` is left
    as it
    was."""
    target = Path(out)
    check_place(target, kind)
    target.parent.mkdir(parents=True, exist_ok=True)
    with replacing_dir(target) as tmp:
        yield tmp
