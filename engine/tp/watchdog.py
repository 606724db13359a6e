"""Deadlines for the tensor-parallel start-up and shutdown steps: a step that hangs (a peer
that never joins the store, an NCCL communicator whose init or destroy never returns, a barrier
a rank never reaches) becomes one error naming the step, instead of a process that never
returns.

`deadline(step, seconds, on_expiry, alive)` watches the step from a daemon thread. When the
step is late, or (rank 0, `alive`) a worker rank exited while it runs, the watcher prints one
line naming the step and runs `on_expiry` (rank 0: kill the workers, so that a call waiting for
them fails; a worker: exit, so that rank 0's next call fails). A step that then returns or
raises raises `StepTimeout` with that line. A step still
blocked GRACE_S later (native code waiting for nothing that will come) cannot be reached from
Python: the process exits with EXIT_CODE after a second line, so a test or a replay fails fast
instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

# step deadlines (seconds): generous against slow hosts, short against a hang
START_S = 180.0  # spawn a worker, join the store, init the process groups (NCCL: eager)
BUILD_S = 1200.0  # every rank builds its shard (a large checkpoint read from disk)
ENGINE_S = 900.0  # an Engine on every rank: profiling forward, KV agreement, graph capture
SHUTDOWN_S = 60.0  # the barrier before teardown, and destroying the process groups
GRACE_S = 10.0  # after the deadline: a step still blocked then ends the process
EXIT_CODE = 124
# caps every deadline above (seconds), e.g. 60 on a GPU check run under an outer timeout;
# the workers inherit it from rank 0's environment
CAP_ENV = "BUBBLESIM_TP_DEADLINE_S"


class StepTimeout(RuntimeError):
    """A tensor-parallel start-up or shutdown step did not finish within its deadline."""


POLL_S = 1.0  # how often the watcher asks `alive`


def message(step: str, seconds: float) -> str:
    return f"tensor-parallel step '{step}' (pid {os.getpid()}) did not finish within {seconds:g} s"


def _late_or_orphaned(
    done: threading.Event, seconds: float, alive: Callable[[], bool] | None
) -> str | None:
    """Wait until the step is done (None), late ("late") or its peers gone ("gone")."""
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if done.wait(max(0.0, min(left, POLL_S if alive is not None else left))):
            return None
        if time.monotonic() >= end:
            return "late"
        if alive is not None and not alive():
            return "gone"


@contextlib.contextmanager
def deadline(
    step: str,
    seconds: float,
    on_expiry: Callable[[], None] | None = None,
    alive: Callable[[], bool] | None = None,
) -> Iterator[None]:
    """Run the body of the `with` as step `step` (module docstring)."""
    cap = os.environ.get(CAP_ENV)
    if cap:
        seconds = min(seconds, float(cap))
    done = threading.Event()
    fired = threading.Event()
    why = {"msg": message(step, seconds)}

    def watch() -> None:
        verdict = _late_or_orphaned(done, seconds, alive)
        if verdict is None:
            return
        if verdict == "gone":
            why["msg"] = f"tensor-parallel step '{step}' (pid {os.getpid()}): a worker rank exited"
        fired.set()
        print(why["msg"], file=sys.stderr, flush=True)
        if on_expiry is not None:
            with contextlib.suppress(Exception):
                on_expiry()
        if not done.wait(GRACE_S):
            print(
                f"{why['msg']}; still blocked {GRACE_S:g} s later: exiting the process with "
                f"code {EXIT_CODE}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_CODE)

    threading.Thread(target=watch, name=f"tp-deadline {step}", daemon=True).start()
    try:
        yield
    except BaseException:
        done.set()
        if fired.is_set():  # it failed because it was late (e.g. its peers were killed)
            raise StepTimeout(why["msg"]) from None
        raise
    done.set()
    if fired.is_set():
        raise StepTimeout(why["msg"])
