"""Write a file or folder whole or not at all: build it under a hidden temp name beside the
target, then rename it into place.

Temp names are `.<target name>.<tmp|old>-<host>-<pid>-<random>`: a process killed before it
could clean up (SIGKILL, power loss) leaves its temp behind, and the next write into the same
folder removes the temps of dead processes of this host (`sweep_stale`). Temps follow the
umask, like any file the user creates (mkdtemp/mkstemp would make them 0700/0600).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
# .<name>.<tmp|old>-<host>-<pid>-<random>
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-")


def _prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{_HOST}-{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (one of another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(parent: Path) -> list[Path]:
    """Remove the temps in `parent` that a dead process of this host left; returns them. A
    `.old` temp (swap_in's previous target) goes back in place if its target is missing (the
    process died between the two renames), else it is deleted. Temps of live processes, of other
    hosts (a shared file system) and names of any other form are left alone."""
    removed: list[Path] = []
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return removed
    for name in entries:
        m = _TEMP_RE.match(name)
        if m is None or m["host"] != _HOST or pid_alive(int(m["pid"])):
            continue
        p = Path(parent) / name
        target = Path(parent) / m["name"]
        with contextlib.suppress(OSError):
            if m["kind"] == "old" and (p / "previous").exists() and not target.exists():
                os.rename(p / "previous", target)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    return removed


def _new_temp(target: Path, kind: str, make: Callable[[Path], None]) -> Path:
    """`make` a new temp path beside `target` (one of a free random name). An exception raised
    as it is made (SIGTERM's Terminated or Ctrl-C's KeyboardInterrupt run after the system call
    that made it) removes what it made: the caller never sees that path, so nothing else would."""
    prefix = _prefix(target, kind)
    for _ in range(100):
        tmp = target.parent / f"{prefix}{os.urandom(4).hex()}"
        try:
            make(tmp)
        except FileExistsError:
            continue
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.rmdir() if tmp.is_dir() else tmp.unlink()
            raise
        return tmp
    raise FileExistsError(f"no free temp name beside '{target}'")


def _make_file(path: Path) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))


def temp_dir(target: Path, kind: str = "tmp") -> Path:
    """A new empty folder beside `target` (same file system: a rename moves it in place),
    mode 0o777 & ~umask. Sweeps dead processes' temps from that folder first."""
    sweep_stale(target.parent)
    return _new_temp(target, kind, lambda p: os.mkdir(p, 0o777))  # the umask applies


@contextlib.contextmanager
def temp_file(target: Path) -> Iterator[Path]:
    """A temp file path beside `target` (created empty, mode 0o666 & ~umask), removed if the
    block fails; the block writes it and renames it onto `target` (os.replace)."""
    sweep_stale(target.parent)
    tmp = _new_temp(target, "tmp", _make_file)
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)  # after os.replace it is gone already


@contextlib.contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A temp file beside `target` for the block to write (temp_file); when the block ends
    normally it is renamed onto `target` (os.replace), if it fails it is removed: `target` is
    always the old file or the whole new one. The parent folder must exist."""
    with temp_file(target) as tmp:
        yield tmp
        os.replace(tmp, target)


@contextlib.contextmanager
def replacing_dir(target: Path) -> Iterator[Path]:
    """A temp folder beside `target` for the block to fill (temp_dir); when the block ends
    normally it is swapped in whole (swap_in), if it fails it is removed: `target` is always the
    old folder or the whole new one. The parent folder must exist."""
    tmp = temp_dir(target)
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
    with replacing(p) as tmp:
        tmp.write_text(text)
    return p


def move_aside(target: Path) -> Path:
    """Move the existing `target` into a new `.old` temp folder beside it (as `previous`);
    returns that folder. If this process dies, the next sweep_stale puts it back."""
    old = temp_dir(target, "old")
    os.rename(target, old / "previous")
    return old


def put_back(old: Path, target: Path) -> None:
    """Undo move_aside: `previous` goes back to `target`, which must not exist."""
    os.rename(old / "previous", target)


def swap_in(tmp: Path, target: Path) -> None:
    """Rename the finished folder `tmp` to `target` (same parent). A previous `target` is moved
    aside first, put back if the rename fails, and deleted after: at no moment is there a
    half-written `target`."""
    if not target.exists():
        os.rename(tmp, target)
        return
    old = move_aside(target)
    try:
        os.rename(tmp, target)
    except BaseException:
        put_back(old, target)
        raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
