"""Pieces shared by every command line (`python -m sim ...`, `python -m replay ...`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn, TypeVar

from bubblesim.core.config import Config, ConfigError, load_config
from bubblesim.core.gpus import get_gpu
from bubblesim.core.models import get_model

if TYPE_CHECKING:
    from concurrent.futures import Future

T = TypeVar("T")


class UsageError(Exception):
    """Bad input found by a command: printed as one line, exit code 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so every cleanup path that handles one handles both."""


def add_config_args(p: argparse.ArgumentParser, output: bool = True) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="sets",
        help="override a config key, e.g. --set spec.k=4 (repeatable)",
    )
    if output:
        p.add_argument(
            "-o",
            "--output",
            metavar="DIR",
            help="where to write (created if missing): an earlier output of this command "
            "there is replaced; anything else is refused unless --force",
        )
        add_force_arg(p)


def add_force_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing -o even if it is not an earlier output of this command "
        "(never the current or home folder)",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    """The config of --config/--set; the model and GPU it names must exist (one line if not),
    checked here so that no command starts work on a name it cannot resolve."""
    return check_names(load_config(args.config, args.sets))


def check_names(cfg: Config) -> Config:
    """The model and GPU `cfg` names must exist: one line (ConfigError) if not."""
    get_model(cfg.model)
    get_gpu(cfg.gpu)
    return cfg


def fail(msg: str) -> NoReturn:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a command's main; turn known bad-input errors into one line and exit code 2."""
    from bubblesim.core.trace import TraceError  # lazy: pyarrow, which `--help` does not need

    global _owner_pid
    _owner_pid = os.getpid()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return main(argv)
    except (ConfigError, TraceError, UsageError, FileNotFoundError) as e:
        fail(str(e))
    except Terminated:
        print("terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


_owner_pid = 0  # the process whose run_main installed _on_sigterm
_deferring = False  # inside sigterm_deferred(): the handler records SIGTERM instead of raising
_terminated = False  # a SIGTERM was recorded and not yet raised


@contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Within this block SIGTERM still stops the worker processes at once, but Terminated is
    raised only by `raise_if_terminated()`, at a point the caller chose. A handler that raises
    wherever the main thread happens to be can leave a lock of concurrent.futures held (a
    future's condition, taken inside `wait`), and the pool's shutdown then waits forever."""
    global _deferring
    before, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = before


def raise_if_terminated() -> None:
    """Raise the SIGTERM that arrived inside sigterm_deferred(), if one did."""
    global _terminated
    if _terminated:
        _terminated = False
        raise Terminated()


def finished(futures: Sequence[Future[T]], each: Callable[[int, T], None]) -> None:
    """Wait for a pool's `futures`, calling `each(index, result)` as each finishes (those that
    finish together in index order); a future's error is raised when it is seen. The waits are
    inside sigterm_deferred(), and a SIGTERM is raised between them (within half a second)."""
    from concurrent.futures import FIRST_COMPLETED, wait  # only commands with a pool need it

    index = {f: i for i, f in enumerate(futures)}
    pending = set(futures)
    with sigterm_deferred():
        while pending:
            raise_if_terminated()
            # a timeout: the loop comes back to raise_if_terminated promptly
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            raise_if_terminated()  # before a result: the workers' ends are its doing
            for f in sorted(done, key=index.__getitem__):
                each(index[f], f.result())
        raise_if_terminated()


def _on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM in the command's process: stop its worker processes (a `kill PID` reaches only
    this one, unlike Ctrl-C, which reaches the whole process group) and unwind like Ctrl-C. A
    forked worker inherits this handler: there it ends the process, as SIGTERM did before."""
    global _terminated
    if os.getpid() != _owner_pid:  # a worker: its pool would catch any exception; just end
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # what it leaves is in the command's temp folder
    # another SIGTERM while the workers are being stopped would kill this process before it
    # stops them (orphans, holding the caller's pipes): ignored until they are
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mp = sys.modules.get("multiprocessing")
    if mp is not None:
        for child in mp.active_children():
            child.terminate()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from now on a second SIGTERM kills at once
    if _deferring:
        _terminated = True
        return
    raise Terminated()
